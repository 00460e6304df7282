"""The MeshSlice LLM autotuner (Nam et al., §3.2): for a transformer's FC layers on a
cluster, the dataflow of each layer, then the mesh shape and each GeMM's number of slices
K, from the cost model of the cluster's resource file.

**Stage 1, dataflow.** Each FC layer ``y = x @ W`` (x: tokens x in, W: in x out) keeps
one matrix stationary: y (output stationary, OS), x (LS) or W (RS). Its two backward
GeMMs follow from the forward's layouts (the paper's Table 1), so the stationary matrix
and its gradient stay in place and no operand is transposed:

=============== ======================= =========================
forward         dx = dy W^T             dW = x^T dy
=============== ======================= =========================
OS over (u, v)  LS over (u, v)          RS over (u, v)
LS over (u, v)  OS over (u, v)          LS over (v, u)
RS over (u, v)  RS over (v, u)          OS over (u, v)
=============== ======================= =========================

The paper keeps the largest matrix stationary. Here, on each mesh shape, the layer takes
the forward dataflow whose three GeMMs (each at its fastest K) the cost model prices
least, the paper's rule only breaking ties (:func:`stationary_dataflow`): the three are
priced for the ranking anyway, and the rule does not know the machines (in one run of
``bench/meshslice.py`` on the emulated 2 x 2, fc1's rule-chosen OS measured 1.14 x the
RS layers that the model priced lower).

**Stage 2, mesh shape and K.** Every factorisation rows x cols of the device count is
tried, the cluster's devices laid out row-major (mesh dim ``x`` over the rows, so on a
machines x devices cluster ``x`` crosses machines; u = x, v = y), skipping shapes whose
columns would split an attention head. Each GeMM's time is MeshSlice's pipeline
(:func:`distgraph.passes.cost.prices.overlap_time`), for each K its layout allows (among
``slices``); each GeMM takes its fastest K, independently of the others. The shapes are
ranked by the time of all FC GeMMs of a training step. As in the paper, a partial GeMM
costs its FLOPs over the device's effective GeMM throughput (the file's ``gflops``, which
``distgraph cluster calibrate`` measures with every rank computing at once) plus one op
launch, and what it reads again (the operand it does not cut, or the result it
accumulates into) at the file's measured ``sliced`` rate per byte; a collective its
alpha-beta on the file's links (concurrent groups crossing the same machines share their
link) plus the measured software cost of its kind.

Example::

    report = dg.passes.meshslice.autotune(layers=24, hidden=2048, heads=16, seq=1024,
                                          batch=8, cluster="cluster.yaml")
    report.best.mesh, report.best.layers[0]       # (2, 4), ('qkv', 'OS', (GemmCost...))
    print(report)                                 # the ranking (printed by autotune too)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from distgraph import dtypes
from distgraph.errors import PlanError
from distgraph.mesh import ProcessMesh
from distgraph.ops.meshslice import local_form, overlap
from distgraph.passes.cost.prices import Rings, collectives_time, overlap_time, roofline_time
from distgraph.placement import DistAttr, ShardSpec
from distgraph.registry import TensorType
from distgraph.resources.cluster import Cluster
from distgraph.spmd.meshslice import SliceLayout, MatmulAxes

ROWS, COLS = "x", "y"
GEMMS = ("forward", "backward_data", "backward_weight")
# forward dataflow -> (dataflow, orientation) of each GeMM; "uv" = (rows, cols)
BACKWARD = {"OS": (("OS", "uv"), ("LS", "uv"), ("RS", "uv")),
            "LS": (("LS", "uv"), ("OS", "uv"), ("LS", "vu")),
            "RS": (("RS", "uv"), ("RS", "vu"), ("OS", "uv"))}


@dataclass(frozen=True)
class GemmCost:
    """The predicted seconds of one GeMM (``gemm``: forward, backward_data or
    backward_weight) of FC layer ``layer``, run as ``dataflow`` over mesh dims ``dims``
    on a ``mesh`` (rows, cols) with ``slices`` K: ``compute``, ``communication`` (its
    collectives back to back) and ``exposed`` (what the pipeline does not hide);
    ``total`` = compute + exposed."""

    layer: str
    gemm: str
    dataflow: str
    mesh: tuple
    dims: tuple
    slices: int
    compute: float
    communication: float
    exposed: float

    @property
    def total(self) -> float:
        return self.compute + self.exposed

    def __str__(self) -> str:
        return (f"{self.layer} {self.gemm}: {self.dataflow} over ({', '.join(self.dims)}) on "
                f"{self.mesh[0]}x{self.mesh[1]}, K={self.slices}: {_ms(self.total)} = "
                f"compute {_ms(self.compute)} + exposed {_ms(self.exposed)} (communication "
                f"{_ms(self.communication)})")


@dataclass(frozen=True)
class MeshShapeCost:
    """One mesh shape: per FC layer (name, forward dataflow, its three GemmCosts with
    their best K), and the step's FC time summed over the model's layers."""

    mesh: tuple
    layers: tuple
    compute: float
    communication: float
    exposed: float

    @property
    def total(self) -> float:
        return self.compute + self.exposed

    @property
    def hidden(self) -> float:
        """The share of the communication the pipelines hide."""
        return 1.0 - self.exposed / self.communication if self.communication else 0.0


@dataclass(frozen=True)
class AutotuneReport:
    """``choices`` (one per mesh shape, fastest first: ``best`` is the first),
    ``candidates`` (every GemmCost priced: each layer, GeMM, dataflow, mesh shape and
    K), ``skipped`` ((mesh shape, why) of the shapes not tried) and the model's figures."""

    model: dict
    devices: int
    dtype: str
    choices: tuple
    candidates: tuple
    skipped: tuple

    @property
    def best(self) -> MeshShapeCost:
        return self.choices[0]

    def candidate(self, layer: str, gemm: str, dataflow: str, mesh: tuple,
                  slices: int) -> GemmCost:
        """The priced GemmCost of that layer, GeMM, dataflow, mesh shape and K."""
        for c in self.candidates:
            if (c.layer, c.gemm, c.dataflow, c.mesh, c.slices) == \
                    (layer, gemm, dataflow, tuple(mesh), slices):
                return c
        raise KeyError(f"no candidate {layer} {gemm} {dataflow} {mesh} K={slices}")

    def __str__(self) -> str:
        m = self.model
        lines = [f"MeshSlice autotuner: {m['layers']} layers, hidden {m['hidden']}, "
                 f"{m['heads']} heads, sequence {m['seq']}, batch {m['batch']}, {self.dtype}, "
                 f"{self.devices} devices; FC GeMMs of one training step, predicted:",
                 "  rank  mesh    total ms  compute ms  communication ms  exposed ms  hidden",
                 ]
        for i, c in enumerate(self.choices):
            lines.append(f"  {i + 1:>4}  {c.mesh[0]}x{c.mesh[1]:<5} {c.total * 1e3:>8.2f}  "
                         f"{c.compute * 1e3:>10.2f}  {c.communication * 1e3:>16.2f}  "
                         f"{c.exposed * 1e3:>10.2f}  {c.hidden:>6.0%}")
        for mesh, why in self.skipped:
            lines.append(f"     -  {mesh[0]}x{mesh[1]:<5} skipped: {why}")
        best = self.best
        lines.append(f"best: mesh {best.mesh[0]}x{best.mesh[1]} (x over the rows, y over the "
                     "columns); per layer, the dataflow and each GeMM's K:")
        for name, dataflow, gemms in best.layers:
            ks = ", ".join(f"{g.gemm} {g.dataflow} K={g.slices}" for g in gemms)
            lines.append(f"  {name}: {dataflow} ({ks})")
        return "\n".join(lines)


def autotune(layers: int, hidden: int, heads: int, seq: int, batch: int, cluster,
             dtype: str = "float32", *, ffn: int = 4, slices=(1, 2, 4, 8, 16),
             devices: int | None = None, verbose: bool = True) -> AutotuneReport:
    """Choose MeshSlice's configuration for a GPT-style transformer (``layers`` blocks of
    qkv (hidden -> 3 hidden), proj, fc1 (hidden -> ``ffn`` hidden) and fc2; ``batch`` x
    ``seq`` tokens) on ``cluster`` (a Cluster or a resource file's path; its first
    ``devices`` devices, default all) in ``dtype``, trying K in ``slices``; prints the
    ranking unless ``verbose=False`` (module docstring)."""
    if not isinstance(cluster, Cluster):
        cluster = Cluster.from_file(cluster)
    n = devices or len(cluster.devices)
    if n > len(cluster.devices):
        raise PlanError(f"autotune on {n} devices, but the cluster has {len(cluster.devices)}")
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads),
                        ("seq", seq), ("batch", batch), ("ffn", ffn)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"autotune: {name}={value!r} must be a positive integer")
    if hidden % heads:
        raise PlanError(f"autotune: hidden={hidden} is not a multiple of heads={heads}")
    dtypes.itemsize(dtype)
    tokens = batch * seq
    fcs = (("qkv", hidden, 3 * hidden), ("proj", hidden, hidden),
           ("fc1", hidden, ffn * hidden), ("fc2", ffn * hidden, hidden))
    choices, candidates, skipped = [], [], []
    for rows in range(1, n + 1):
        if n % rows:
            continue
        shape = (rows, n // rows)
        why = _unfit(shape, heads, tokens, fcs)
        if why:
            skipped.append((shape, why))
            continue
        priced = _price_mesh(shape, fcs, tokens, cluster, dtype, tuple(slices))
        candidates.extend(priced["all"])
        if not priced["layers"]:
            skipped.append((shape, "no K in slices divides its shards"))
            continue
        per_layer = priced["layers"]
        total = [sum(getattr(g, f) for _, _, gs in per_layer for g in gs) * layers
                 for f in ("compute", "communication", "exposed")]
        choices.append(MeshShapeCost(shape, tuple(per_layer), *total))
    if not choices:
        raise PlanError("autotune: no mesh shape fits: " +
                        "; ".join(f"{r}x{c}: {why}" for (r, c), why in skipped))
    choices.sort(key=lambda c: (c.total, c.mesh))
    report = AutotuneReport({"layers": layers, "hidden": hidden, "heads": heads, "seq": seq,
                             "batch": batch, "ffn": ffn}, n, dtype, tuple(choices),
                            tuple(candidates), tuple(skipped))
    if verbose:
        print(report)
    return report


def stationary_dataflow(tokens: int, n_in: int, n_out: int) -> str:
    """The paper's stage 1 (here the tie-breaker of the priced choice): the forward
    dataflow that keeps the largest of x (tokens x in), W and y (tokens x out) in place;
    ties go to y, then x."""
    return _by_size(tokens, n_in, n_out)[0]


def _by_size(tokens: int, n_in: int, n_out: int) -> list:
    sizes = {"OS": tokens * n_out, "LS": tokens * n_in, "RS": n_in * n_out}
    return sorted(("OS", "LS", "RS"), key=lambda d: -sizes[d])


def _unfit(shape, heads, tokens, fcs) -> str:
    rows, cols = shape
    if heads % cols:
        return f"{cols} columns would split one of the {heads} heads"
    for name, n_in, n_out in fcs:
        for n in (tokens, n_in, n_out):
            if n % rows or n % cols:
                return f"{name}'s dims ({tokens}, {n_in}, {n_out}) do not divide {rows}x{cols}"
    return ""


def gemm_shapes(gemm: str, tokens: int, n_in: int, n_out: int) -> tuple:
    """(x shape, y shape, attrs) of an FC layer's GeMM as the program runs it."""
    if gemm == "forward":
        return (tokens, n_in), (n_in, n_out), {}
    if gemm == "backward_data":
        return (tokens, n_out), (n_in, n_out), {"transpose_y": True}
    return (tokens, n_in), (tokens, n_out), {"transpose_x": True}


def price_gemm(layer: str, gemm: str, dataflow: str, dims: tuple, shapes: tuple,
               attrs: dict, mesh: ProcessMesh, cluster, dtype: str, slices) -> list:
    """The GemmCost of each K in ``slices`` that ``dataflow`` over ``dims`` allows for the
    GeMM of ``shapes`` and ``attrs`` on ``mesh`` (process p on the cluster's p-th device;
    priced on process 0)."""
    in_shapes = [tuple(s) for s in shapes]
    axes = MatmulAxes.of(in_shapes, attrs)
    lay = SliceLayout(dataflow, *dims)
    sizes = dict(zip(mesh.dim_names, mesh.shape))
    local = local_form(lay, axes, in_shapes, sizes)
    x_spec, y_spec, _ = lay.specs(axes, in_shapes)
    ins = [TensorType(DistAttr(mesh, ShardSpec(spec.dims)).local_shape(shape), dtype)
           for spec, shape in zip((x_spec, y_spec), in_shapes)]
    devices = cluster.devices

    def device_of(pid):
        return devices[pid].global_id

    device = cluster.device(device_of(0))
    rings = Rings(cluster, device_of)

    def ring_of(dim):
        return rings.along(mesh, 0, dim)

    found = []
    for ov in overlap({**attrs, "meshslice": local}, ins):
        if ov.slices not in slices:
            continue
        compute, exposed = overlap_time(ov, device, ring_of, roofline_time)
        found.append(GemmCost(layer, gemm, dataflow, tuple(mesh.shape), dims, ov.slices,
                              compute, collectives_time(ov, device, ring_of), exposed))
    return found


def _price_mesh(shape, fcs, tokens, cluster, dtype, slices) -> dict:
    mesh = ProcessMesh(np.arange(shape[0] * shape[1]).reshape(shape).tolist(), [ROWS, COLS])
    every, per_layer = [], []
    for name, n_in, n_out in fcs:
        families = []
        for rank, forward in enumerate(_by_size(tokens, n_in, n_out)):
            best_of = []
            for gemm, (dataflow, orient) in zip(GEMMS, BACKWARD[forward]):
                dims = (ROWS, COLS) if orient == "uv" else (COLS, ROWS)
                x, y, attrs = gemm_shapes(gemm, tokens, n_in, n_out)
                priced = price_gemm(name, gemm, dataflow, dims, (x, y), attrs, mesh, cluster,
                                    dtype, slices)
                every.extend(priced)
                if priced:
                    best_of.append(min(priced, key=lambda g: (g.total, g.slices)))
            if len(best_of) == len(GEMMS):
                families.append((sum(g.total for g in best_of), rank, forward, best_of))
        if not families:
            return {"all": every, "layers": []}
        _, _, chosen, best_of = min(families, key=lambda f: f[:2])
        per_layer.append((name, chosen, tuple(best_of)))
    return {"all": every, "layers": per_layer}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"
