"""Alpa's inter-op stage construction (OSDI'22, §5, eq. 5): a DP over (layers, submesh).

Given ``L`` layers in order, a Cluster's device meshes and a cost callback
``cost(layers: range, submesh: Submesh) -> StageCost`` (in a planner: the intra-op search
and the cost model; here a parameter), :func:`plan_stages` splits the layers into
consecutive stages, gives each stage a submesh of one device mesh so that the submeshes
cover every device exactly once, and minimises the pipeline latency of ``B`` micro-batches

    T = sum_i t_i + (B - 1) * max_i t_i

under each device's usable memory: a stage with ``s`` stages after it keeps ``s`` more
micro-batches of activations in flight (1F1B; FThenB keeps all ``B`` on every stage:
:func:`~distgraph.passes.cost.stage.in_flight`), so it needs
``memory + s * activation_memory <= device.usable_memory()`` (GB, the resource file's
unit: the device's memory less its reserve).

Submesh shapes (Alpa's, so that any mix whose sizes add up to a mesh can be placed on it):
on a device mesh of shape ``(N, M)`` (a 1-D mesh ``(n,)`` is ``(1, n)``), rows of ``1, 2,
4, ...`` devices (powers of two that divide ``M``) and ``n`` full rows ``(n, M)``. Full-row
stages take whole rows, then the row pieces are packed largest first; every piece divides
``M`` and the smaller ones divide the larger, so they fill the remaining rows exactly.

The search (Alpa's): for a cap ``t_max`` on every stage's time, ``F(s, k, d)`` is the least
summed time of layers ``k..L-1`` in ``s`` stages on ``d`` devices (one count per device
mesh), each stage within the cap and its memory::

    F(s, k, d) = min over i >= k, submesh o with size(o) <= d of
                 t(k..i, o) + F(s - 1, i + 1, d - size(o))

and ``T = min over t_max of min_s F(s, 0, all devices) + (B - 1) * t_max``. The caps tried
are the distinct stage times; ``F`` only falls as the cap rises, so a bisection over the
sorted caps skips any interval whose lower bound ``F(at its top) + (B - 1) * (its lowest
cap)`` cannot beat the best plan found: the answer is exact, and few caps are solved.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> def cost(layers, sub):          # a layer takes 1 s on one device; no speedup
    ...     return StageCost(time=len(layers) / sub.size ** 0.5, memory=0.0)
    >>> plan = plan_stages(4, Cluster.local(2), cost, micro_batches=8)
    >>> [(s.layers, s.device_ids) for s in plan.stages]
    [(range(0, 2), (0,)), (range(2, 4), (1,))]
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from distgraph.errors import DoesNotFit, PlanError
from distgraph.mesh import ProcessMesh
from distgraph.resources.cluster import Cluster, Device, DeviceMesh
from distgraph.passes.cost.stage import flights, grid, held, in_flight, step_time
from distgraph.passes.search.layouts.space import logical_dims


@dataclass(frozen=True)
class Submesh:
    """A submesh shape on one device mesh, before placement; ``device`` is one of the
    mesh's (identical) devices, for its GFLOP/s and memory."""

    mesh: DeviceMesh
    shape: tuple[int, int]
    device: Device

    @property
    def size(self) -> int:
        return self.shape[0] * self.shape[1]

    def __str__(self):
        return f"{self.mesh.name}{list(self.shape)}"


@dataclass(frozen=True)
class StageCost:
    """What the callback returns for one (layers, submesh): seconds per micro-batch
    (forward + backward, and the update's share ``update / M``), memory per device in GB
    with one micro-batch in flight, the memory of each further one (GB), the memory with
    one in flight where every forward runs before the first backward (GB; None: as
    ``memory``; :func:`~distgraph.passes.cost.stage.held`'s ``one_before``) and the
    update's seconds once a step."""

    time: float
    memory: float
    activation_memory: float = 0.0
    before: float | None = None
    update: float = 0.0


@dataclass(frozen=True)
class StageChoice:
    """One pipeline stage: its layers, submesh, devices, seconds per micro-batch (the
    update's share included: ``update / M``), peak memory per device (GB) and its
    update's seconds once a step."""

    layers: range
    mesh: str
    shape: tuple[int, int]
    device_ids: tuple[int, ...]
    time: float
    memory: float
    update: float = 0.0

    def __str__(self):
        last = self.layers.stop - 1
        return (f"layers {self.layers.start}-{last} on {self.mesh}{list(self.shape)} "
                f"devices {list(self.device_ids)}: {self.time:.6g} s, {self.memory:.4g} GB")


@dataclass(frozen=True)
class StagePlan:
    """Stages in pipeline order; ``objective`` = sum t / virtual + (micro_batches -
    1 / virtual) * max t; ``dp_runs``: how many time caps the search solved; ``virtual``: chunks per
    stage (interleaved 1F1B; the stages' layers are then those annotated before the
    planner moves chunk c to stage c mod S)."""

    stages: tuple[StageChoice, ...]
    objective: float
    micro_batches: int
    dp_runs: int
    virtual: int = 1

    def __str__(self):
        chunks = f", {self.virtual} chunks per stage" if self.virtual > 1 else ""
        head = (f"{len(self.stages)} stages{chunks}, {self.micro_batches} micro-batches: "
                f"latency {self.objective:.6g} s")
        return "\n".join([head] + [f"  {i}: {s}" for i, s in enumerate(self.stages)])


def submesh_shapes(shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """Alpa's submesh shapes of a device mesh, smallest first.

    >>> submesh_shapes((4, 8))
    [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8), (4, 8)]
    """
    rows, cols = grid(shape)
    pieces = [1 << k for k in range(cols.bit_length()) if cols % (1 << k) == 0 and 1 << k < cols]
    return [(1, m) for m in pieces] + [(n, cols) for n in range(1, rows + 1)]


@dataclass
class _Option:
    """One submesh choice and its cost tables over layer ranges [k, i] (inf where i < k):
    :class:`StageCost`'s five figures."""

    axis: int            # which device mesh
    sub: Submesh
    time: np.ndarray
    memory: np.ndarray
    act: np.ndarray
    before: np.ndarray
    update: np.ndarray

    def at(self, k: int, i: int) -> tuple:
        """(time, memory, activation memory, memory before, update) of layers k..i."""
        return (self.time[k, i], self.memory[k, i], self.act[k, i], self.before[k, i],
                self.update[k, i])


def plan_stages(num_layers: int, cluster: Cluster,
                cost: Callable[[range, Submesh], StageCost | tuple],
                micro_batches: int = 1,
                shapes: dict[str, list[tuple[int, int]]] | None = None,
                schedule: str = "1F1B") -> StagePlan:
    """Split ``num_layers`` layers into pipeline stages on submeshes of ``cluster`` (see the
    module docstring). ``shapes`` restricts the submesh shapes per device mesh name (each
    one of :func:`submesh_shapes`); ``cost`` may return a ``StageCost`` or a tuple
    ``(time, memory[, activation_memory])``; ``schedule``: whose micro-batches in flight
    a stage holds. Raises ``PlanError`` when no split fits."""
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise PlanError(f"plan_stages: num_layers = {num_layers!r}; give a whole number >= 1")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) \
            or micro_batches < 1:
        raise PlanError(f"plan_stages: micro_batches = {micro_batches!r}; give a whole "
                        "number >= 1")
    meshes = list(cluster.device_meshes)
    if num_layers < len(meshes):
        raise PlanError(f"{num_layers} layers cannot cover the {len(meshes)} device meshes "
                        f"of cluster {cluster.name or '(unnamed)'}: every stage holds at least "
                        "one layer and every device holds a stage; use more layers (a finer "
                        "layer split) or fewer meshes")
    options = _options(num_layers, cluster, meshes, cost, shapes)
    limits = [min(cluster.device(i).usable_memory() for i in m.ids) for m in meshes]
    sizes = [m.size for m in meshes]
    search = _Search(num_layers, sizes, options, limits, micro_batches, schedule)
    best = search.run()
    if best is None:
        if _Search(num_layers, sizes, options, [math.inf] * len(meshes), 1).run() is None:
            raise PlanError(f"no split of {num_layers} layers into stages covers every device "
                            "with the submesh shapes allowed ("
                            f"{', '.join(sorted({str(o.sub) for o in options}))}) and stage "
                            "times below inf; allow more shapes (e.g. (1, 1) or full rows)")
        raise DoesNotFit(_no_fit_message(num_layers, meshes, options, limits))
    return _place([(k, i, options[n]) for k, i, n in best], meshes, micro_batches,
                  search.runs, schedule)


def _options(L, cluster, meshes, cost, shapes) -> list[_Option]:
    if shapes is not None:
        unknown = set(shapes) - {m.name for m in meshes}
        if unknown:
            raise PlanError(f"plan_stages: shapes names meshes {sorted(unknown)} that cluster "
                            f"{cluster.name or '(unnamed)'} does not have; its meshes are "
                            f"{[m.name for m in meshes]}")
    options = []
    for axis, mesh in enumerate(meshes):
        allowed = submesh_shapes(mesh.shape)
        chosen = allowed if shapes is None or mesh.name not in shapes else \
            [tuple(int(x) for x in s) for s in shapes[mesh.name]]
        for s in chosen:
            if s not in allowed:
                raise PlanError(f"plan_stages: submesh shape {list(s)} on mesh {mesh.name} "
                                f"{list(mesh.shape)} is not one the DP can place; use some of "
                                f"{[list(a) for a in allowed]}")
        device = cluster.device(mesh.ids[0])
        for s in chosen:
            sub = Submesh(mesh, s, device)
            tables = np.full((5, L, L), np.inf)
            tables[1:] = 0.0
            for k in range(L):
                for i in range(k, L):
                    tables[:, k, i] = _stage_cost(cost, range(k, i + 1), sub)
            options.append(_Option(axis, sub, *tables))
    return options


def _stage_cost(cost, layers: range, sub: Submesh) -> tuple:
    """The five figures of :class:`StageCost` of ``cost(layers, sub)``."""
    out = cost(layers, sub)
    extra = (None, 0.0)
    if isinstance(out, StageCost):
        extra = (out.before, out.update)
        out = (out.time, out.memory, out.activation_memory)
    try:
        values = tuple(float(x) for x in out)
    except (TypeError, ValueError):
        values = ()
    if len(values) == 2:
        values += (0.0,)
    where = f"cost(layers {layers.start}-{layers.stop - 1}, submesh {sub})"
    if len(values) != 3:
        raise PlanError(f"{where} returned {out!r}; return StageCost(time, memory, "
                        "activation_memory) or a tuple (time, memory[, activation_memory])")
    if not all(math.isfinite(x) and x >= 0 for x in values[1:]) or \
            not (values[0] >= 0 and not math.isnan(values[0])):
        raise PlanError(f"{where} returned {values}; times and memories are numbers >= 0 "
                        "(time may be inf for a stage that cannot run there)")
    before, update = extra
    return values + (values[1] if before is None else float(before), float(update))


class _Search:
    """The DP for one time cap, and the bisection over caps (module docstring)."""

    def __init__(self, L, capacities, options, limits, micro_batches, schedule="1F1B"):
        self.L, self.caps, self.options = L, capacities, options
        self.limits, self.B = limits, micro_batches
        self.dims = tuple(c + 1 for c in capacities)
        self.max_stages = min(L, sum(capacities))
        self.flights = flights(schedule, micro_batches, self.max_stages)
        self.runs = 0
        times = np.concatenate([o.time[np.isfinite(o.time)] for o in options])
        self.caps_sorted = np.unique(times)

    def solve_cap(self, cap: float):
        """(summed time, stages as (k, i, option)) within ``cap``, or (inf, None)."""
        self.runs += 1
        L, R = self.L, math.prod(self.dims)
        F = np.full((L + 1,) + self.dims, np.inf)
        F[(L,) + (0,) * len(self.dims)] = 0.0
        full = np.ravel_multi_index(tuple(self.caps), self.dims)
        choices, best, best_s = [], math.inf, None
        for s in range(1, self.max_stages + 1):
            H = F[1:]                                    # suffix from i + 1, indexed by i
            G = np.full((L + 1, R), np.inf)              # F(s, k, state), states flattened
            pick_o = np.full((L, R), -1)
            pick_i = np.zeros((L, R), dtype=np.intp)
            for n, o in enumerate(self.options):
                ok = (o.time <= cap) & (o.memory + (self.flights[s] - 1) * o.act
                                        <= self.limits[o.axis])
                T = np.where(ok, o.time, np.inf)
                shifted = _shift(H, 1 + o.axis, o.sub.size).reshape(L, R)
                cand = T[:, :, None] + shifted[None, :, :]          # (k, i, state)
                arg = cand.argmin(axis=1)
                val = np.take_along_axis(cand, arg[:, None, :], axis=1)[:, 0, :]
                better = val < G[:L]
                G[:L][better] = val[better]
                pick_o[better], pick_i[better] = n, arg[better]
            choices.append((pick_o, pick_i))
            F = G.reshape((L + 1,) + self.dims)
            if G[0, full] < best:
                best, best_s = float(G[0, full]), s
        if best_s is None:
            return math.inf, None
        return best, self._walk(choices, best_s)

    def _walk(self, choices, s):
        stages, k, state = [], 0, list(self.caps)
        while s:
            pick_o, pick_i = choices[s - 1]
            idx = np.ravel_multi_index(tuple(state), self.dims)
            n, i = int(pick_o[k, idx]), int(pick_i[k, idx])
            stages.append((k, i, n))
            state[self.options[n].axis] -= self.options[n].sub.size
            k, s = i + 1, s - 1
        return stages

    def objective(self, stages) -> float:
        return float(step_time([self.options[n].at(k, i)[0] for k, i, n in stages], self.B))

    def run(self, below: float = math.inf):
        """The stages of the least objective, or None when none fits; with ``below``,
        only a plan whose objective is below it (None when there is none), which
        prunes the caps from the start."""
        caps = self.caps_sorted
        if caps.size == 0:
            return None
        found: dict[int, float] = {}
        best = [below, None]

        def at(j):
            if j not in found:
                total, stages = self.solve_cap(float(caps[j]))
                found[j] = total
                if stages is not None and self.objective(stages) < best[0]:
                    best[:] = [self.objective(stages), stages]
            return found[j]

        hi = len(caps) - 1
        if math.isinf(at(hi)):
            return None
        lo_bad, lo = -1, hi                  # feasibility only grows with the cap
        if math.isfinite(below):            # the bound prunes infeasible caps too
            lo = lo_bad
        while lo - lo_bad > 1:
            mid = (lo_bad + lo) // 2
            if math.isinf(at(mid)):
                lo_bad = mid
            else:
                lo = mid
        todo = [(lo, hi)]
        while todo:
            a, b = todo.pop()
            if b - a <= 1 or at(b) + (self.B - 1) * caps[a + 1] >= best[0]:
                continue
            mid = (a + b) // 2
            at(mid)
            todo += [(a, mid), (mid, b)]
        return best[1]


def _shift(H: np.ndarray, axis: int, size: int) -> np.ndarray:
    """out[..., d, ...] = H[..., d - size, ...] along ``axis`` (inf where d < size)."""
    out = np.full_like(H, np.inf)
    n = H.shape[axis]
    if size < n:
        dst = [slice(None)] * H.ndim
        src = [slice(None)] * H.ndim
        dst[axis], src[axis] = slice(size, None), slice(0, n - size)
        out[tuple(dst)] = H[tuple(src)]
    return out


def _place(stages, meshes, micro_batches, runs, schedule="1F1B") -> StagePlan:
    """Give each stage its devices: per mesh, full-row stages take whole rows, then the
    row pieces go largest first into the first row with room (they fill it exactly)."""
    # `stages` holds (k, i, option); options carry the mesh axis and submesh.
    total = len(stages)
    placed: dict[int, tuple[int, ...]] = {}
    for axis, mesh in enumerate(meshes):
        rows, cols = grid(mesh.shape)
        ids = np.array(mesh.ids).reshape(rows, cols)
        mine = [(j, st) for j, st in enumerate(stages) if st[2].axis == axis]
        mine.sort(key=lambda js: (-js[1][2].sub.size, js[0]))
        fill = [0] * rows
        row = 0
        for j, (_, _, o) in mine:
            n, m = o.sub.shape
            if m == cols:
                placed[j] = tuple(int(x) for x in ids[row:row + n].reshape(-1))
                fill[row:row + n] = [cols] * n
                row += n
            else:
                r = next(r for r in range(rows) if cols - fill[r] >= m)
                placed[j] = tuple(int(x) for x in ids[r, fill[r]:fill[r] + m])
                fill[r] += m
    out = []
    for j, (k, i, o) in enumerate(stages):
        # a run option's row has the memory where all forwards run first (stage.held)
        # and its update's seconds once a step
        t, mem, act, *rest = o.at(k, i)
        out.append(StageChoice(range(k, i + 1), o.sub.mesh.name, o.sub.shape, placed[j], float(t),
                               float(held(mem, act, in_flight(schedule, micro_batches, total, j),
                                          micro_batches, *rest[:1])),
                               float(rest[1]) if len(rest) > 1 else 0.0))
    return StagePlan(tuple(out), step_time([s.time for s in out], micro_batches),
                     micro_batches, runs)


def _no_fit_message(L, meshes, options, limits) -> str:
    per_mesh = []
    for axis, mesh in enumerate(meshes):
        mine = [o for o in options if o.axis == axis]
        need = min(float(np.min(np.diag(o.memory))) for o in mine)
        finite = any(np.isfinite(np.diag(o.time)).any() for o in mine)
        per_mesh.append(f"mesh {mesh.name} (devices with {limits[axis]:g} GB usable): one "
                        f"layer needs at least {need:g} GB per device" +
                        ("" if finite else ", and no submesh can run a layer"))
    return (f"no split of {L} layers into stages fits the devices' memory (with the "
            "activations 1F1B keeps in flight) while covering every device: "
            f"{'; '.join(per_mesh)}")


def logical_mesh(device_mesh, shape, logical) -> tuple[ProcessMesh, dict]:
    """A ProcessMesh of ``logical`` shape over the submesh ``shape`` (the first rows and
    columns of ``device_mesh``), and process -> device global id: process p is the
    p-th device of the submesh in row-major order, so dim ``y`` runs inside a row."""
    rows, cols = shape
    ids = np.array(device_mesh.ids).reshape(grid(device_mesh.shape))[:rows, :cols]
    mesh = ProcessMesh(np.arange(rows * cols).reshape(logical).tolist(),
                       dim_names=logical_dims(logical))
    return mesh, dict(enumerate(int(d) for d in ids.reshape(-1)))
