"""``Plan.explain()``: a plan in words, as long for 1,024 processes as for 4.

The first line says the processes, stages (and chunks), micro-batches and schedule, and
whether the plan fits its devices: the largest peak of the estimate against the usable
memory of that process's device, and that device's memory (from the plan's cluster;
"memory not estimated" where the plan has no estimate, and not checked where it has no
cluster). **Usable memory** is what the planner fits plans to: the device's memory less
its reserve (the resource file's ``reserved_memory``, or the default for its type), at
most ``Strategy(memory_budget_gb)`` where given (``Device.usable_memory``). Every size is
said in one unit, decimal bytes (:func:`~distgraph.units.fmt_bytes`: GB as resource
files give memory). Then per stage:

- its mesh (shape and dim names), its processes, ranks and devices as ranges
  (``0-63``, ``64-127, 192-255``) and the devices' model, memory and usable memory;
- its layout, from the program's dist attrs: the most common specs the forward matmuls'
  activations are computed in, the specs their weights are held in (and the mesh dims
  those split over), how many other parameters are split, and the mesh dims the
  optimizer states are split over beyond their parameter's (ZeRO);
- the layers each of its chunks holds;
- one line per group of alike processes (``Plan.groups``, split further where the
  estimate's figures differ): the processes as ranges, peak memory against the usable,
  compute and communication seconds and bytes sent per step;
- its model FLOPs per step, TFLOP/s per device at the predicted step time and MFU.

Then the predicted step time (compute + communication + bubble of the busiest process;
"uncalibrated", with the command that measures the machine, where the cluster's figures
are defaults: :mod:`distgraph.plan.figures`), the model FLOPs, TFLOP/s per device and MFU
of the whole plan (and a word on precision where float32 runs on devices with a much
faster 16-bit rate); the reshards and the
collectives inside ops counted per kind with the bytes of the busiest process; the
search's and the batch split's summaries; and where the full listing is
(``Plan.explain(full=True)``, :mod:`distgraph.plan.listing`).

**Model FLOPs** (:func:`model_flops`): the FLOPs the op registry gives the forward, loss
and backward ops of the training program at their global shapes, times the
micro-batches where ``program`` is the micro-batch program; not the update's ops, and
not recomputation's copies of forward ops (:func:`distgraph.ir.is_recomputed`: work the
hardware does again, not the model's). **MFU** = model FLOPs per step / step time /
the sum over the plan's devices of their peak FLOP/s (``Device.gflops``) for the dtype
that carries most of the model FLOPs (with alike devices: / devices / one device's peak).

Example::

    print(plan.explain())              # the summary
    print(plan.explain(full=True))     # every rank, reshard point, parameter, ...
"""

from __future__ import annotations

from collections import Counter
from functools import cached_property

from distgraph.errors import PlanError
from distgraph.ir import Role, is_recomputed
from distgraph.plan.figures import UNCALIBRATED, calibrated, calibration_note, precision_note
from distgraph.plan.kinds import ItemKind, TaskKind
from distgraph.registry import FLOP_BOUND, op_flops
from distgraph.units import fmt_bytes, fmt_ids

GROUP_LINES = 6        # lines of groups of processes per stage before the rest is counted
SPECS = 3              # the most common specs a layout line names
LAYERS = 100           # characters of layer names per chunk before the rest is counted
GB = 1e9               # resource files give memory in GB
COUNTED = (Role.FORWARD, Role.LOSS, Role.BACKWARD)


def model_flops(plan) -> dict:
    """{dtype: FLOPs} of one step's model FLOPs (module docstring), by the dtype of the
    op's first result."""
    return _by_dtype(_counted(plan))


def _by_dtype(counted) -> dict:
    out: dict = {}
    for op, flops in counted:
        dtype = op.outputs[0].dtype if op.outputs else "float32"
        out[dtype] = out.get(dtype, 0.0) + flops
    return out


def _counted(plan) -> list:
    """(op, FLOPs per step) of each op that counts towards the model FLOPs."""
    m = plan.micro_batches
    out = []
    for op in plan.program.ops:
        if op.role in COUNTED and not is_recomputed(op):
            flops = op_flops(op)
            if flops:
                out.append((op, flops * m))
    return out


def memory_figures(plan, estimate=None, cluster=None) -> dict | None:
    """Bytes of the largest peak of ``plan``'s estimate, of what its process's device may
    hold (its usable memory, module docstring) and of that device's memory:
    ``{"process", "peak", "usable", "device"}`` (usable and device None without a
    cluster); None without an estimate. What ``explain()``'s first line, ``to_dict()``
    and the plan file say. ``estimate`` / ``cluster``: those to use where the plan has none."""
    return Summary(plan, estimate, cluster).memory_figures()


def summary(plan, estimate=None, cluster=None) -> str:
    """The summary of ``plan`` (module docstring). ``estimate`` / ``cluster``: those to
    use where the plan has none (else the plan's)."""
    return "\n".join(Summary(plan, estimate, cluster).lines())


class Summary:
    """What the summary reads once: the estimate per process, each process's device,
    the model FLOPs per stage, the bytes each process sends (the plan's report
    (:mod:`.report`) reads the others too)."""

    def __init__(self, plan, estimate, cluster):
        self.plan = plan
        self.estimate = estimate if estimate is not None else plan.estimate
        self.cluster = cluster if cluster is not None else plan.cluster
        # read once: a cluster makes the list of its devices anew when asked
        self.devices = self.cluster.devices if self.cluster is not None else None
        self.figures = {} if self.estimate is None else \
            {p.process: p for p in self.estimate.processes}
        counted = _counted(plan)
        self.flops = sum(f for _, f in counted)
        by_dtype = _by_dtype(counted)
        self.dtype = max(by_dtype, key=by_dtype.get) if by_dtype else None
        self.stage_of: dict = {}
        for s, mesh in enumerate(plan.stages):
            for q in mesh.process_ids:
                self.stage_of.setdefault(q, s)
        self.stage_flops = [0.0] * len(plan.stages)
        for op, f in counted:
            s = self._stage_of_mesh(op.dist_attr.mesh if op.dist_attr else None)
            if s is not None:
                self.stage_flops[s] += f

    # -- facts ------------------------------------------------------------------------------
    @cached_property
    def sent(self) -> dict:
        """{process: {kind: bytes}} each process sends per step (counted only when asked:
        every process's tasks are walked, a minute at 16,384 processes)."""
        return self.plan.bytes_sent() if self.plan.distributed else {}

    def _stage_of_mesh(self, mesh):
        if mesh is None:
            return 0 if len(self.plan.stages) == 1 else None
        stages = {self.stage_of.get(q) for q in mesh.process_ids}
        return stages.pop() if len(stages) == 1 else None

    def device(self, pid):
        """The cluster's Device of process ``pid``, or None without a cluster."""
        if self.devices is None:
            return None
        rank = self.plan.ranks(pid)
        if rank >= len(self.devices):
            return None
        return self.devices[rank]

    def memory(self, pid) -> float:
        """Bytes of memory of ``pid``'s device (0: not known)."""
        device = self.device(pid)
        return device.memory * GB if device is not None else 0.0

    def memory_figures(self) -> dict | None:
        """:func:`memory_figures` of this summary's plan, estimate and cluster."""
        if self.estimate is None:
            return None
        top = max(self.estimate.processes, key=lambda p: p.peak_memory)
        known = self.device(top.process) is not None
        return {"process": top.process, "peak": float(top.peak_memory),
                "usable": self.usable(top.process) if known else None,
                "device": self.memory(top.process) if known else None}

    def usable(self, pid) -> float:
        """Bytes ``pid``'s device may hold: its usable memory, at most the strategy's
        budget (``Device.usable_memory``, the limit the planner fits to; 0: not known)."""
        device = self.device(pid)
        if device is None:
            return 0.0
        return device.usable_memory(self.plan.strategy.memory_budget_gb) * GB

    def peak_flops(self, pids) -> float:
        """The sum of the devices' peak FLOP/s of ``pids`` for the model's dtype (0 where
        one of them gives none)."""
        total = 0.0
        for q in pids:
            device = self.device(q)
            rate = device.flops(self.dtype) if device is not None and self.dtype else 0.0
            if not rate:
                return 0.0
            total += rate
        return total

    # -- lines ------------------------------------------------------------------------------
    def lines(self) -> list:
        plan = self.plan
        fits, over = self.fits()
        out = [f"{self.head()}; {fits}", *over]
        placed = set()
        for s, mesh in enumerate(plan.stages):
            out += self.stage(s, mesh)
            placed.update(mesh.process_ids)
        rest = [q for q in plan.process_ids if q not in placed]
        if rest:
            out.append(f"  outside the stages: {_ids('process', rest)}")
            out += self.group_lines(rest)
        out += self.totals()
        out += self.communication()
        out += self.extras()
        out.append("  the full listing (every rank, reshard point and parameter, the schedule, "
                   "each process's estimate): plan.explain(full=True)")
        return out

    def head(self) -> str:
        plan = self.plan
        chunks = len(plan.graph.chunks) if plan.graph is not None else len(plan.stages)
        of = f" of {chunks} chunks" if chunks != len(plan.stages) else ""
        stages = len(plan.stages)
        return (f"Plan: {plan.world_size} process(es), "
                f"{'distributed' if plan.distributed else 'serial'}, {stages} "
                f"stage{'s' if stages != 1 else ''}{of}, {plan.micro_batches} "
                f"micro-batch{'es' if plan.micro_batches != 1 else ''}, "
                f"schedule {plan.order.name}")

    def fits(self) -> tuple:
        """Whether the plan fits its devices, in words: (the end of the first line, the
        lines after it: the processes over their device's memory, if any)."""
        if self.estimate is None:
            return "memory not estimated (no estimate)", []
        top = max(self.estimate.processes, key=lambda p: p.peak_memory)
        peak = fmt_bytes(top.peak_memory)
        if self.cluster is None:
            return f"memory not estimated against devices (no cluster); largest peak {peak}", []
        usable = self.usable(top.process)
        if not usable:
            return f"largest peak {peak}; the cluster gives no device memory to check it", []
        over = [p.process for p in self.estimate.processes
                if self.usable(p.process) and p.peak_memory > self.usable(p.process)]
        share = top.peak_memory / usable
        said = self.usable_said(top.process)
        if over:
            return (f"does NOT fit: largest peak {peak} of {fmt_bytes(usable)} usable "
                    f"({share:.0%})",
                    [f"  over their device's usable memory: {_ids('process', over, limit=4)}",
                     *said])
        return (f"fits its devices: largest peak {peak} of {fmt_bytes(usable)} usable "
                f"({share:.1%})"), said

    def usable_said(self, pid) -> list:
        """Where ``pid``'s device's usable memory is less than its memory, a line saying
        why: the reserve, the strategy's budget; else none (all of it is usable)."""
        device, budget = self.device(pid), self.plan.strategy.memory_budget_gb
        memory, usable = self.memory(pid), self.usable(pid)
        if usable >= memory:
            return []
        why = []
        if device.reserve:
            why.append(f"less {fmt_bytes(device.reserve * GB)} reserved (the runtime's "
                       "context, the communicators' buffers, the allocator's slack)")
        if usable < device.usable_memory() * GB:
            why.append(f"at most Strategy(memory_budget_gb={budget:g})")
        return [f"  usable memory {fmt_bytes(usable)}: the device's {fmt_bytes(memory)} "
                + ", ".join(why)]

    def stage(self, s, mesh) -> list:
        plan = self.plan
        out = [f"  stage {s}: mesh {list(mesh.shape)} ({', '.join(mesh.dim_names)}), "
               f"{self.where(mesh.process_ids)}"]
        out += [f"    {line}" for line in layout(plan, mesh)]
        out.append(f"    holds {holdings(plan, mesh)}")
        out += self.group_lines([q for g in plan.groups for q in g
                                 if self.stage_of.get(g[0]) == s])
        out.append(f"    {self.throughput(self.stage_flops[s], mesh.process_ids, stage=True)}")
        return out

    def where(self, pids) -> str:
        """The processes, their ranks where they differ, their devices and the devices'
        model and memory."""
        plan = self.plan
        pids = sorted(pids)
        text = _ids("process", pids)
        ranks = [plan.ranks(q) for q in pids]
        if ranks != pids:
            # a few: each process's rank in process order; many: the ranks' ranges
            text += (" as ranks " + ", ".join(map(str, ranks)) if len(ranks) <= 8 else
                     f" as {_ids('rank', ranks)}" + (" (in another order: plan.rank_of)"
                                                     if sorted(ranks) == pids else ""))
        devices = [self.device(q) for q in pids]
        if any(d is None for d in devices):
            return text
        text += f" on {_ids('device', [d.global_id for d in devices])}"
        kinds = Counter((d.type if d.model.lower() in ("", d.type.lower()) else
                         f"{d.type} {d.model}") + f", {fmt_bytes(d.memory * GB)}" +
                        (f", {fmt_bytes(self.usable(q))} usable"
                         if self.usable(q) < d.memory * GB else "")
                        for q, d in zip(pids, devices))
        return text + " (" + "; ".join(f"{n} {k}" if len(kinds) > 1 else k
                                       for k, n in kinds.items()) + ")"

    def group_lines(self, pids) -> list:
        """One line per group of alike processes among ``pids`` (Plan.groups, split where
        the estimate or the bytes sent differ), at most GROUP_LINES, then a count."""
        member = {q: g for g in self.plan.groups for q in g}
        groups: dict = {}
        for q in pids:
            p = self.figures.get(q)
            figures = None if p is None else (p.peak_memory, p.compute, p.communication)
            key = (member.get(q, (q,))[0], figures, self.usable(q),
                   sum(self.sent.get(q, {}).values()))
            groups.setdefault(key, []).append(q)
        out = []
        for (_, figures, usable, sent), members in list(groups.items())[:GROUP_LINES]:
            text = f"    {_ids('process', members, limit=4)}: "
            if figures is None:
                text += "memory and time not estimated"
            else:
                peak, compute, comm = figures
                of = f" of {fmt_bytes(usable)} usable ({peak / usable:.1%})" if usable else ""
                text += (f"peak {fmt_bytes(peak)}{of}, compute {_fmt_time(compute)}, "
                         f"communication {_fmt_time(comm)}")
            out.append(text + (f", sends {fmt_bytes(sent)} per step" if self.plan.distributed
                               else " per step"))
        hidden = list(groups.items())[GROUP_LINES:]
        if hidden:
            out.append(f"    ... {len(hidden)} more group(s) of alike processes "
                       f"({sum(len(m) for _, m in hidden)} processes; the full listing has "
                       "each)")
        return out

    def throughput(self, flops, pids, stage=False) -> str:
        """Model FLOPs per step, TFLOP/s per device at the step time, MFU."""
        share = f" ({flops / self.flops:.1%} of the step's)" if stage and self.flops else ""
        text = f"model FLOPs {_fmt_flops(flops)} per step{share}"
        if self.estimate is None or not self.estimate.step_time:
            return text + "; step time not estimated"
        per_device, mfu = self.rates(flops, pids)
        text += f": {_fmt_rate(per_device)} per device"
        if mfu is None:
            why = "no cluster" if self.cluster is None else \
                f"the devices give no GFLOP/s for {self.dtype}"
            return text + f", MFU not known ({why})"
        return text + f", MFU {mfu:.2%}"

    def rates(self, flops, pids) -> tuple:
        """(model FLOP/s per device of ``pids`` at the predicted step time, MFU: their
        share of the devices' peak FLOP/s, None where a device gives none) of ``flops``
        per step; needs an estimated step time."""
        per_device = flops / self.estimate.step_time / len(pids)
        peak = self.peak_flops(pids)
        return per_device, (flops / self.estimate.step_time / peak if peak else None)

    def totals(self) -> list:
        plan, est = self.plan, self.estimate
        if est is None:
            out = ["  step time not estimated (no estimate)"]
        else:
            guess = "" if calibrated(self.cluster) else f" ({UNCALIBRATED})"
            out = [f"  step {_fmt_time(est.step_time)} predicted{guess} = compute "
                   f"{_fmt_time(est.compute)} + communication {_fmt_time(est.communication)} "
                   f"+ bubble {_fmt_time(est.bubble)} (of the busiest process)"]
            out += [f"    {line}" for line in calibration_note(self.cluster)]
        times = f" x {plan.micro_batches} micro-batches" if plan.micro_batches > 1 else ""
        out.append(f"  {self.throughput(self.flops, plan.process_ids)}")
        out.append(f"    (forward, loss and backward ops{times}, recomputation not counted"
                   + (f"; MFU against the devices' {self.dtype} GFLOP/s in the cluster)"
                      if self.dtype else ")"))
        out += [f"  {line}" for line in precision_note(
            self.dtype, self.devices[:plan.world_size] if self.devices is not None else None)]
        return out

    def communication(self) -> list:
        plan = self.plan
        if not plan.distributed:
            return []
        points = plan.reshards()
        kinds = Counter(str(step.kind) for p in points for step in p.steps)
        counts = ", ".join(f"{k} {n}" for k, n in kinds.most_common())
        out = [f"  reshard points: {len(points)} ({sum(kinds.values())} steps: {counts})"
               if points else "  reshard points: none"]
        inside: dict = {}
        for local in plan.representatives():
            ops = local.program.ops
            for index, collectives in local.op_comm.items():
                for kind, _, _ in collectives:
                    inside.setdefault((str(kind), ops[index].type), set()).add(
                        (ops[index].layer, index, str(ops[index].dist_attr.mesh)))
        if inside:
            text = ", ".join(f"{kind} {len(where)} ({op})"
                             for (kind, op), where in sorted(inside.items()))
            out.append(f"  collectives inside ops: {text}")
        if self.sent:
            pid = max(self.sent, key=lambda q: sum(self.sent[q].values()))
            mine = sorted(self.sent[pid].items(), key=lambda kv: -kv[1])
            text = ", ".join(f"{k} {fmt_bytes(b)}" for k, b in mine if b)
            out.append(f"  busiest process {pid} sends {fmt_bytes(sum(self.sent[pid].values()))}"
                       f" per step" + (f": {text}" if text else ""))
        return out

    def extras(self) -> list:
        plan = self.plan
        out = []
        if plan.devices is not None:
            out.append(f"  {_backend(plan.devices)}")
        if plan.accumulation is not None:
            out.append("  " + plan.accumulation.pretty().splitlines()[0])
        if plan.sliced:
            flows = Counter(use.local.dataflow for use in plan.sliced)
            out.append(f"  MeshSlice: {len(plan.sliced)} matmul(s) as 2-D GeMMs with K sliced ("
                       + ", ".join(f"{d} {n}" for d, n in flows.items()) + ")")
        out += [f"  {line}" for c in plan.savers for line in c.lines()]
        for extra in (plan.search, plan.batch_split):
            if extra is not None:
                out.append("  " + extra.summary().replace("\n", "\n  "))
        if plan.checkpoint is not None:
            out.append(f"  {plan.checkpoint}")
        return out


def _ids(noun: str, ids, limit: int = 6) -> str:
    """``"process 3"``, ``"processes 0-63"``."""
    return f"{noun}{'es' if noun.endswith('s') else 's'} {fmt_ids(ids, limit)}" \
        if len(set(ids)) > 1 else f"{noun} {fmt_ids(ids)}"


def _backend(devices) -> str:
    """One line: the array backend, the devices' types, GPUs shared by several ranks."""
    try:
        backend = devices.backend
    except PlanError:
        return f"backend: none (ranks on {' and '.join(devices.types)} devices at once)"
    shared = devices.sharing()
    text = f"backend: {backend} on {len(devices.devices)} {'/'.join(devices.types)} rank(s)"
    if shared:
        text += (f"; {len(shared)} GPU(s) shared by several ranks (MPI with host staging "
                 "between them)")
    return text


def _fmt_time(seconds: float) -> str:
    """``"37.9 ms"``, ``"28.86 s"``: four significant digits."""
    return f"{seconds:.4g} s" if seconds >= 1 else f"{seconds * 1e3:.4g} ms"


def _fmt_flops(flops: float) -> str:
    """``"53.19 TFLOP"``: four significant digits in decimal units."""
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6),
                       ("kFLOP", 1e3)):
        if flops >= size:
            return f"{flops / size:.4g} {unit}"
    return f"{flops:.4g} FLOP"


def _fmt_rate(per_second: float) -> str:
    """``"22.5 TFLOP/s"``, in GFLOP/s or MFLOP/s below a TFLOP/s."""
    for unit, size in (("TFLOP/s", 1e12), ("GFLOP/s", 1e9)):
        if per_second >= size:
            return f"{per_second / size:.3g} {unit}"
    return f"{per_second / 1e6:.3g} MFLOP/s"


def layout(plan, mesh) -> list:
    """Two lines: the specs the stage's forward matmuls compute their activations in,
    and the layout of its weights, other parameters and optimizer states."""
    program = plan.program
    producer = {o.name: op for op in program.ops for o in op.outputs}
    params = [v for v in program.parameters if v.dist_attr is not None
              and v.dist_attr.mesh == mesh]
    acts, weights = Counter(), {}
    for op in program.ops:
        if op.role is not Role.FORWARD or op.type not in FLOP_BOUND or op.dist_attr is None \
                or op.dist_attr.mesh != mesh:
            continue
        for v, spec in zip(op.inputs, op.dist_attr.input_specs):
            source = _parameter_behind(v, producer)
            if source is not None:
                weights[source.name] = source
            else:
                acts[str(spec)] += 1
    held = Counter(str(v.dist_attr.spec) for v in weights.values())
    over = sorted({d for v in weights.values() for d in v.dist_attr.spec.mesh_dims()})
    first = (f"layout: matmul activations {_top(acts)}" if acts else
             "layout: no matmul in the forward")
    text = (f"weights: matmul {_top(held)} ({'split over ' + ', '.join(over) if over else 'not split'})"
            if weights else "weights: no matmul weight")
    others = [v for v in params if v.name not in weights]
    if others:
        split = [v for v in others if v.dist_attr.spec.mesh_dims()]
        text += f"; other parameters {len(split)} of {len(others)} split"
    beyond = _states_beyond(program, params)
    if beyond:
        text += f"; optimizer states also split over {', '.join(beyond)} (ZeRO)"
    return [first, text]


def _parameter_behind(value, producer):
    """The parameter ``value`` is, or is made from by forward ops of one operand (a
    cast, a reshape), else None."""
    seen = 0
    while not value.is_parameter and seen < 4:
        op = producer.get(value.name)
        if op is None or len(op.inputs) != 1 or op.role is not Role.FORWARD:
            return None
        value, seen = op.inputs[0], seen + 1
    return value if value.is_parameter else None


def _states_beyond(program, params) -> list:
    """Mesh dims the optimizer states of ``params`` are split over beyond their
    parameter's spec (ZeRO's dims)."""
    specs = {v.name: set(v.dist_attr.spec.mesh_dims()) for v in params}
    extra = set()
    for v in program.values.values():
        if not v.persistable or v.is_parameter or v.dist_attr is None:
            continue
        owner = v.name.split("@", 1)[0]
        if owner in specs:
            extra |= set(v.dist_attr.spec.mesh_dims()) - specs[owner]
    return sorted(extra)


def _top(counts: Counter) -> str:
    shown = ", ".join(f"{spec} x{n}" for spec, n in counts.most_common(SPECS))
    more = len(counts) - SPECS
    return shown + (f" (+{more} other spec{'s' if more > 1 else ''})" if more > 0 else "")


def holdings(plan, mesh) -> str:
    """The layers each chunk on ``mesh`` runs the forward of: ``chunk 0: wte, wpe,
    blocks.0-3``."""
    graph = plan.graph
    chunks = [c for c, m in enumerate(graph.chunks) if m == mesh] if graph is not None else []
    pid = mesh.process_ids[0]
    if not chunks or pid not in plan.process_ids:
        return "no chunk of the forward"
    ops = plan.local_alike(pid).program.ops
    tasks = graph.tasks_of(pid)
    parts = []
    for c in chunks:
        task = tasks.get((c, TaskKind.FORWARD))
        layers = []
        for it in task.items if task is not None else ():
            if it.kind is ItemKind.OP:
                op = ops[it.index]
                # a parameter read outside its layer (GPT's wpe, sliced at the top level)
                layers += [v.name.rpartition(".")[0] for v in op.inputs if v.is_parameter]
                layers.append(op.layer)
        parts.append(f"chunk {c}: {_layer_ranges(layers)}")
    return "; ".join(parts)


def _layer_ranges(layers) -> str:
    """Layer paths in first-seen order, each cut after its first numbered part
    (``blocks.3.attn.qkv`` -> ``blocks.3``), consecutive numbers joined
    (``blocks.0-3``, ``fc1-4``); past LAYERS characters, how many more."""
    names = []
    for layer in layers:
        if not layer:
            continue
        parts = layer.split(".")
        cut = next((k for k, p in enumerate(parts) if p.isdigit()), None)
        name = ".".join(parts[:cut + 1]) if cut is not None else parts[0]
        if name not in names:
            names.append(name)
    runs: list = []                        # [prefix, first, last] or [name]
    for name in names:
        stem = name.rstrip("0123456789")
        number = name[len(stem):]
        last = runs[-1] if runs else None
        if number and last is not None and len(last) == 3 and last[0] == stem \
                and int(number) == last[2] + 1:
            last[2] = int(number)
        else:
            runs.append([stem, int(number), int(number)] if number else [name])
    words = [r[0] if len(r) == 1 else f"{r[0]}{r[1]}" if r[1] == r[2] else
             f"{r[0]}{r[1]}-{r[2]}" for r in runs]
    text, shown = "", 0
    for word in words:
        if len(text) + len(word) > LAYERS:
            break
        text, shown = (f"{text}, {word}" if text else word), shown + 1
    if shown < len(words):
        text += f", ... ({len(words) - shown} more)"
    return text or "no layer of the model (the loss)"
