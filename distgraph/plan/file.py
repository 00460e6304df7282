"""Plans as files: ``plan.save(path)`` writes what was decided, :func:`read` reads it back.

Design (issue #51). A plan file holds the **decisions**, not the plan: the layouts the
planner completed from (the search's choice written on the program it runs, or the
user's ``shard_tensor`` / ``shard_op`` annotations of a plan made without search), the
stage meshes and the chunks per stage the stage search chose, the Strategy (micro-batch
count, schedule, recomputation, ZeRO), the rank mapping; and the **prints** of what they
were made for (:mod:`distgraph.plan.fingerprint`): the program, the cluster, the world
size. Loading (:mod:`distgraph.passes.plan_file`) rebuilds the program from the user's
model as the planner does, checks the prints, writes the decisions back on and makes the
plan as the planner makes a searched one, without searching: completion, partition,
schedule and estimate are pure functions of the decisions, so the plan is the same. What
loading costs is therefore planning less the search (bench/plan_file.py: a third to a
half of planning's time for GPT-3 on 1,024 GPUs and Llama 3 405B on 16,384): the file
keeps decisions, not their consequences (completed layouts, local programs, estimate),
which the code that reads it may price differently in a later version.

The file stays small whatever the process count: every mesh and every ShardSpec is
written once, in a table (``meshes``, ``specs``), and the decisions refer to them by
number; a mesh's processes are written as their first id where they are a run; the rank
mapping as runs of processes on consecutive devices. Nothing is written per process
(``Plan.to_json()`` lists every process's schedule and bytes: 577 MB for 70B on 16,384
GPUs; the same plan's file: see bench/plan_file.py).

Reading checks the file whole before anything uses it, and every fault is one
:class:`~distgraph.errors.PlanFileError` naming the file, the key and what is wrong: a file
that is not JSON or was cut short, a format version newer than :data:`VERSION`, a key
missing or of the wrong form, mesh or spec numbers out of range, process ids beyond the
world size, a spec naming a mesh dim its mesh lacks. What needs the program (an op
number beyond it, a layout its rules refuse) is checked when the plan is made from it.

Format (``version`` 1)::

    {"format": "distgraph-plan", "version": 1, "distgraph": "0.5.0",
     "world_size": 4, "program": {...print...}, "cluster": {...print...} | null,
     "strategy": {...Strategy fields...},
     "meshes": [{"shape": [2, 2], "dims": ["x", "y"], "first": 0} | {..., "ids": [...]}],
     "specs": [[[null, "x"], ["y"]], ...],           # dims entries, partial dims
     "decisions": {"on": "prepared" | "built",
                   "values": [[name, mesh, spec], ...],
                   "ops": [[op index, mesh, [[operand, spec], ...]], ...],
                   "chunks": null | {"stages": [mesh, ...], "virtual": 2},
                   "rank_mapping": null | [[process, device, count], ...],
                   "zero_dim": null | "x" | ["x", "y"],
                   "zero_params": null | [parameter name, ...]},   # optional
     "result": {"stages": [mesh, ...], "micro_batches": 4, "step_time": 0.1,
                "peak_memory": bytes, "usable_memory": bytes, "device_memory": bytes}}

Example::

    plan.save("gpt.plan.json")
    saved = read("gpt.plan.json")          # checked; saved.strategy, saved.decisions ...
    saved.check_world(4); saved.check_cluster(cluster); saved.check_program(built)
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass

import numpy as np

from distgraph.annotation import OpAnnotation
from distgraph.errors import DistGraphError, PlanFileError
from distgraph.mesh import ProcessMesh
from distgraph.placement import DistAttr, ShardSpec
from distgraph.plan.explain import memory_figures
from distgraph.plan.fingerprint import (cluster_difference, cluster_print,
                                        program_difference, program_print)
from distgraph.strategy import Strategy
from distgraph.version import __version__

FORMAT = "distgraph-plan"
VERSION = 1


@dataclass(frozen=True)
class Decisions:
    """What a plan was made from (module docstring), as the planner records it:
    ``program``, the print of the built program it was given; ``on``, which program the
    layouts annotate ("built": the model's own, a plan made without search; "prepared":
    the program the plan runs, split into micro-batches and rewritten for recomputation,
    as the search wrote its choice); ``values`` ((name, DistAttr), ...) and ``ops``
    ((op index, OpAnnotation), ...): the annotations; ``chunks``: (stage meshes, chunks
    per stage) where the stage search interleaved its stages, else None; ``zero_dim``:
    the mesh dims ZeRO shards the optimizer states over as the search named them (None:
    no ZeRO, or the strategy's ``sharding_mesh_dim``); ``zero_params``: the parameters
    whose updates ZeRO shards where the search chose them per update (None: every
    update ZeRO splits; a file without the key says so)."""

    program: dict | None
    on: str
    values: tuple = ()
    ops: tuple = ()
    chunks: tuple | None = None
    zero_dim: str | tuple | None = None
    zero_params: tuple | None = None


@dataclass(frozen=True)
class PlanFile:
    """A plan file read and checked whole (:func:`read`): its decisions decoded into
    values, the prints, the strategy, the rank mapping ({process: device global id} or
    None) and ``result``, what the saved plan came to (stages, micro-batches, estimate),
    for the caller to compare."""

    path: str
    version: int
    world_size: int
    program: dict
    cluster: dict | None
    strategy: Strategy
    decisions: Decisions
    rank_mapping: dict | None
    result: dict
    written_by: str = ""        # the distgraph version that wrote the file

    def fault(self, what: str, fix: str = "") -> PlanFileError:
        """A PlanFileError about this file."""
        return PlanFileError(f"plan file {self.path}: {what}" + (f"; {fix}" if fix else ""),
                             self.path)

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise self.fault(f"the plan was made for {self.world_size} processes; the job "
                             f"has {world_size}", f"launch it with -n {self.world_size}, "
                             f"or plan again for {world_size}")

    def check_cluster(self, cluster) -> None:
        said = cluster_difference(self.cluster, cluster_print(cluster))
        if said:
            raise self.fault(said, "use the resource file it was made for (--cluster), or "
                             "plan again for this cluster")

    def check_program(self, built) -> None:
        said = program_difference(self.program, program_print(built))
        if said:
            raise self.fault(said, "plan this model again (distgraph plan SCRIPT --save "
                             "PATH)")


# -- writing ------------------------------------------------------------------------------
def encode(plan) -> dict:
    """``plan`` as a plan file's data (module docstring)."""
    decisions = plan.decisions
    if decisions is None:
        raise PlanFileError("this plan holds no decisions to save (it was not made by "
                            "dg.passes.plan)")
    table = _Tables()
    mapping = None
    if plan.rank_of is not None and plan.cluster is not None:
        devices = plan.cluster.devices
        mapping = _runs({p: devices[r].global_id for p, r in plan.rank_of.items()})
    chunks = None
    if decisions.chunks is not None:
        stages, virtual = decisions.chunks
        chunks = {"stages": [table.mesh(m) for m in stages], "virtual": virtual}
    data = {
        "values": [[name, table.mesh(a.mesh), table.spec(a.spec)]
                   for name, a in decisions.values],
        "ops": [[index, table.mesh(a.mesh),
                 [[key, None if s is None else table.spec(s)] for key, s in a.in_specs]]
                for index, a in decisions.ops],
        "on": decisions.on, "chunks": chunks, "rank_mapping": mapping,
        "zero_dim": _listed(decisions.zero_dim),
        "zero_params": None if decisions.zero_params is None else list(decisions.zero_params)}
    est = plan.estimate
    memory = memory_figures(plan) or {}
    result = {"stages": [table.mesh(m) for m in plan.stages],
              "micro_batches": plan.micro_batches,
              "step_time": None if est is None else est.step_time,
              "peak_memory": memory.get("peak"), "usable_memory": memory.get("usable"),
              "device_memory": memory.get("device")}
    return {"format": FORMAT, "version": VERSION, "distgraph": __version__,
            "world_size": plan.world_size, "program": decisions.program,
            "cluster": cluster_print(plan.cluster),
            "strategy": dataclasses.asdict(plan.strategy),
            "meshes": table.meshes, "specs": table.specs, "decisions": data,
            "result": result}


def as_text(plan) -> str:
    """``plan``'s file as its text (what :func:`save` writes; :func:`from_text` reads it)."""
    return json.dumps(encode(plan), separators=(",", ":"))


def save(plan, path) -> None:
    """Write ``plan``'s file to ``path`` atomically (a reader never sees half a file)."""
    text = as_text(plan)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".plan-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)       # as open() would make it, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class _Tables:
    """The file's mesh and spec tables, each entry written once."""

    def __init__(self):
        self.meshes: list = []
        self.specs: list = []
        self._mesh: dict = {}
        self._mesh_of: dict = {}
        self._held: list = []
        self._spec: dict = {}

    def mesh(self, mesh) -> int:
        # by identity first: the decisions share mesh objects, and equal meshes of
        # thousands of processes compare their ids one by one
        k = self._mesh_of.get(id(mesh))
        if k is not None:
            return k
        k = self._mesh.get(mesh)
        if k is None:
            k = self._mesh[mesh] = len(self.meshes)
            ids = list(mesh.process_ids)
            out = {"shape": list(mesh.shape), "dims": list(mesh.dim_names)}
            if ids == list(range(ids[0], ids[0] + len(ids))):
                out["first"] = ids[0]
            else:
                out["ids"] = ids
            self.meshes.append(out)
        self._mesh_of[id(mesh)] = k
        self._held.append(mesh)         # alive while its id is a key
        return k

    def spec(self, spec) -> int:
        k = self._spec.get(spec)
        if k is None:
            k = self._spec[spec] = len(self.specs)
            self.specs.append([[list(e) if isinstance(e, tuple) else e for e in spec.dims],
                               sorted(spec.partial)])
        return k


def _listed(dims):
    """ZeRO's mesh dims as JSON: None, a name, or a list of names."""
    return list(dims) if isinstance(dims, tuple) else dims


def _runs(mapping: dict) -> list:
    """{process: device} as [[first process, first device, count], ...]: runs of
    consecutive processes on consecutive devices."""
    runs: list = []
    for p in sorted(mapping):
        d = mapping[p]
        if runs and runs[-1][0] + runs[-1][2] == p and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += 1
        else:
            runs.append([p, d, 1])
    return runs


# -- reading ------------------------------------------------------------------------------
def read(path) -> PlanFile:
    """The plan file at ``path``, checked whole (module docstring); a PlanFileError
    names the first fault."""
    path = str(path)
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise PlanFileError(f"plan file {path}: cannot be read ({e.strerror})", path) from None
    return from_text(text, path)


def from_text(text: str, path: str) -> PlanFile:
    """The plan file whose text is ``text``, checked whole as :func:`read` checks one;
    ``path`` names it in the errors."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        cut = not text.rstrip().endswith("}")      # a plan file is one JSON object
        raise PlanFileError(
            f"plan file {path}: not a complete plan file: its JSON breaks at line "
            f"{e.lineno} column {e.colno} ({e.msg})"
            f"{', and it ends before its last }: it was cut short' if cut else ''}: save "
            f"the plan again "
            f"(plan.save(path) or distgraph plan SCRIPT --save PATH)", path) from None
    return _Reader(path, data).plan_file()


class _Reader:
    """Checks and decodes one file's data, naming the key at fault."""

    def __init__(self, path: str, data):
        self.path, self.data = path, data

    def fault(self, key: str, what: str) -> PlanFileError:
        return PlanFileError(f"plan file {self.path}: {key}: {what}", self.path)

    def get(self, parent, key: str, kind, where: str):
        if not isinstance(parent, dict) or key not in parent:
            raise self.fault(where, "missing (the file was cut short or edited)")
        value = parent[key]
        if kind is not None and not _is(value, kind):
            raise self.fault(where, f"expected {_kind_name(kind)}, got {value!r:.60}")
        return value

    def plan_file(self) -> PlanFile:
        data = self.data
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanFileError(f"plan file {self.path}: not a distgraph plan file (no "
                                f"\"format\": \"{FORMAT}\")", self.path)
        version = self.get(data, "version", int, "version")
        if version > VERSION:
            raise self.fault("version", f"format version {version} was written by a newer "
                             f"distgraph ({data.get('distgraph', 'unknown')}); this one "
                             f"({__version__}) reads versions up to {VERSION}: upgrade "
                             f"distgraph, or save the plan again with this one")
        if version < 1:
            raise self.fault("version", f"{version} is no format version (1..{VERSION})")
        world = self.get(data, "world_size", int, "world_size")
        if world < 1:
            raise self.fault("world_size", f"{world}: a plan has at least one process")
        self.world = world
        program = self.get(data, "program", dict, "program")
        for key, kind in (("mode", str), ("layers", int), ("feeds", list),
                          ("parameters", list), ("ops", int), ("layer_digests", dict),
                          ("digest", str)):
            self.get(program, key, kind, f"program.{key}")
        cluster = self.get(data, "cluster", (dict, type(None)), "cluster")
        if cluster is not None:
            for key, kind in (("name", str), ("devices", int), ("kinds", list),
                              ("digest", str)):
                self.get(cluster, key, kind, f"cluster.{key}")
        strategy = self.strategy(self.get(data, "strategy", dict, "strategy"))
        self.meshes = [self.mesh(m, f"meshes[{k}]")
                       for k, m in enumerate(self.get(data, "meshes", list, "meshes"))]
        self.specs = [self.spec(s, f"specs[{k}]")
                      for k, s in enumerate(self.get(data, "specs", list, "specs"))]
        decisions, mapping = self.decisions(
            self.get(data, "decisions", dict, "decisions"), program)
        result = self.get(data, "result", dict, "result")
        stages = [self.mesh_at(m, f"result.stages[{k}]")
                  for k, m in enumerate(self.get(result, "stages", list, "result.stages"))]
        self.get(result, "micro_batches", int, "result.micro_batches")
        for key in ("step_time", "peak_memory", "usable_memory", "device_memory"):
            if key in result:
                self.get(result, key, (int, float, type(None)), f"result.{key}")
        result = dict(result, stages=tuple(stages))
        return PlanFile(self.path, version, world, program, cluster, strategy, decisions,
                        mapping, result, str(data.get("distgraph", "")))

    def strategy(self, fields: dict) -> Strategy:
        known = {f.name for f in dataclasses.fields(Strategy)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise self.fault("strategy", f"unknown field {unknown[0]!r} (Strategy has "
                             f"{', '.join(sorted(known))})")
        given = dict(fields)
        if isinstance(given.get("recompute"), list):
            given["recompute"] = tuple(given["recompute"])
        try:
            return Strategy(**given)
        except DistGraphError as e:
            raise self.fault("strategy", str(e)) from None

    def mesh(self, entry, where: str) -> ProcessMesh:
        shape = self.get(entry, "shape", list, f"{where}.shape")
        dims = self.get(entry, "dims", list, f"{where}.dims")
        if not all(_is(n, int) and n >= 1 for n in shape):
            raise self.fault(f"{where}.shape", f"{shape}: sizes must be integers >= 1")
        size = 1
        for n in shape:
            size *= n
        if "first" in entry:
            first = self.get(entry, "first", int, f"{where}.first")
            ids = list(range(first, first + size))
        else:
            ids = self.get(entry, "ids", list, f"{where}.ids")
            if not all(_is(i, int) for i in ids) or len(ids) != size:
                raise self.fault(f"{where}.ids", f"expected {size} process ids (shape "
                                 f"{shape}), got {ids!r:.80}")
        bad = [i for i in ids if not 0 <= i < self.world]
        if bad:
            raise self.fault(where, f"process {bad[0]} is out of range: the plan has "
                             f"{self.world} processes (0..{self.world - 1})")
        try:
            return ProcessMesh(np.array(ids, dtype=np.int64).reshape(shape), dims)
        except (DistGraphError, ValueError) as e:
            raise self.fault(where, str(e)) from None

    def spec(self, entry, where: str) -> ShardSpec:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], list)
                and isinstance(entry[1], list)):
            raise self.fault(where, f"expected [dims, partial dims], got {entry!r:.60}")
        try:
            return ShardSpec([tuple(e) if isinstance(e, list) else e for e in entry[0]],
                             entry[1])
        except DistGraphError as e:
            raise self.fault(where, str(e)) from None

    def mesh_at(self, k, where: str) -> ProcessMesh:
        if not _is(k, int) or not 0 <= k < len(self.meshes):
            raise self.fault(where, f"mesh number {k!r} is out of range (the file has "
                             f"{len(self.meshes)} meshes)")
        return self.meshes[k]

    def spec_at(self, k, where: str) -> ShardSpec:
        if not _is(k, int) or not 0 <= k < len(self.specs):
            raise self.fault(where, f"spec number {k!r} is out of range (the file has "
                             f"{len(self.specs)} specs)")
        return self.specs[k]

    def attr(self, mesh, spec, where: str, what: str) -> DistAttr:
        unknown = [d for d in spec.mesh_dims() if d not in mesh.dim_names]
        if unknown:
            raise self.fault(where, f"{what}'s spec {spec} names mesh dim {unknown[0]!r}, "
                             f"but its mesh {mesh} has dims {list(mesh.dim_names)}")
        try:
            return DistAttr(mesh, spec)
        except DistGraphError as e:
            raise self.fault(where, f"{what}: {e}") from None

    def decisions(self, entry: dict, program: dict) -> tuple:
        on = self.get(entry, "on", str, "decisions.on")
        if on not in ("built", "prepared"):
            raise self.fault("decisions.on", f"{on!r}: expected 'built' or 'prepared'")
        values = []
        for k, row in enumerate(self.get(entry, "values", list, "decisions.values")):
            where = f"decisions.values[{k}]"
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str)):
                raise self.fault(where, f"expected [name, mesh, spec], got {row!r:.60}")
            mesh, spec = self.mesh_at(row[1], where), self.spec_at(row[2], where)
            values.append((row[0], self.attr(mesh, spec, where, f"value {row[0]!r}")))
        ops = []
        for k, row in enumerate(self.get(entry, "ops", list, "decisions.ops")):
            where = f"decisions.ops[{k}]"
            if not (isinstance(row, list) and len(row) == 3 and _is(row[0], int)
                    and row[0] >= 0 and isinstance(row[2], list)):
                raise self.fault(where, f"expected [op index, mesh, [[operand, spec], "
                                 f"...]], got {row!r:.60}")
            mesh = self.mesh_at(row[1], where)
            wanted = []
            for j, pair in enumerate(row[2]):
                if not (isinstance(pair, list) and len(pair) == 2
                        and isinstance(pair[0], (str, int))):
                    raise self.fault(f"{where}[2][{j}]", f"expected [operand, spec], got "
                                     f"{pair!r:.60}")
                spec = None if pair[1] is None else self.spec_at(pair[1], f"{where}[2][{j}]")
                if spec is not None:
                    self.attr(mesh, spec, f"{where}[2][{j}]", f"op #{row[0]}'s operand "
                              f"{pair[0]!r}")
                wanted.append((pair[0], spec))
            ops.append((row[0], OpAnnotation(mesh, tuple(wanted))))
        chunks = self.get(entry, "chunks", (dict, type(None)), "decisions.chunks")
        if chunks is not None:
            stages = tuple(self.mesh_at(m, f"decisions.chunks.stages[{k}]") for k, m in
                           enumerate(self.get(chunks, "stages", list,
                                              "decisions.chunks.stages")))
            virtual = self.get(chunks, "virtual", int, "decisions.chunks.virtual")
            if virtual < 1:
                raise self.fault("decisions.chunks.virtual", f"{virtual}: at least 1")
            chunks = (stages, virtual)
        runs = self.get(entry, "rank_mapping", (list, type(None)), "decisions.rank_mapping")
        mapping = None if runs is None else self.mapping(runs)
        zero = self.get(entry, "zero_dim", (str, list, type(None)), "decisions.zero_dim")
        if isinstance(zero, list):
            if not all(isinstance(n, str) for n in zero):
                raise self.fault("decisions.zero_dim", f"expected mesh dim names, got {zero}")
            zero = tuple(zero)
        dims = {n for m in self.meshes for n in m.dim_names}
        unknown = [n for n in ((zero,) if isinstance(zero, str) else zero or ()) if n not in dims]
        if unknown:
            raise self.fault("decisions.zero_dim", f"{unknown[0]!r} is no mesh dim of the "
                             f"plan (its meshes have dims {', '.join(sorted(dims))})")
        params = entry.get("zero_params")
        if params is not None and not (isinstance(params, list) and
                                       all(isinstance(n, str) for n in params)):
            raise self.fault("decisions.zero_params", f"expected parameter names, got "
                             f"{params!r:.60}")
        if params is not None and on != "prepared":
            raise self.fault("decisions.zero_params", "only a searched plan's decisions "
                             "(\"on\": \"prepared\") name the updates ZeRO shards; a plan of "
                             "annotations shards every update Strategy(sharding=True) splits")
        return Decisions(program, on, tuple(values), tuple(ops), chunks, zero,
                         None if params is None else tuple(params)), mapping

    def mapping(self, runs: list) -> dict:
        out: dict = {}
        for k, run in enumerate(runs):
            where = f"decisions.rank_mapping[{k}]"
            if not (isinstance(run, list) and len(run) == 3 and all(_is(x, int) for x in run)
                    and run[0] >= 0 and run[1] >= 0 and run[2] >= 1):
                raise self.fault(where, f"expected [first process, first device, count], "
                                 f"got {run!r:.60}")
            first, device, count = run
            if first + count > self.world:
                raise self.fault(where, f"processes {first}..{first + count - 1} are out of "
                                 f"range: the plan has {self.world} processes")
            for j in range(count):
                if first + j in out:
                    raise self.fault(where, f"process {first + j} is mapped twice")
                out[first + j] = device + j
        return out


def _is(value, kind) -> bool:
    """isinstance, where a bool is not an int."""
    if isinstance(value, bool) and kind is not bool:
        return False
    return isinstance(value, kind)


def _kind_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {dict: "an object", list: "a list", int: "an integer", str: "a string",
             float: "a number", type(None): "null"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)


