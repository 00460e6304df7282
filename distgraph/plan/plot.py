"""A picture of a Plan: ``plan.plot(path)`` and ``distgraph plan SCRIPT --plot PNG``.

One column per stage (its mesh drawn as a grid of process ids), the model's layers in it
in program order, each weight matrix drawn as a box cut by the mesh dims that split it
(the rows or the columns, a colour per mesh dim) with its name, shape and what each mesh
dim does to it (a split the forward all-gathers first is "stored, gathered to use": the
processes compute on the whole weight), whether its op computes on the batch split over
mesh dims or on the whole batch (the stage's header says how the batch is split), and
under each layer the reshards the plan inserts there (forward, backward, update) with the
bytes a process sends. Arrows between columns carry the activations and gradients that
cross stages, with their bytes.

:func:`picture` is the pure part (the plan summarised as values); :func:`plot_plan`
draws it with matplotlib (``pip install 'distgraph[plot]'``).

Example::

    plan = engine.plan()
    plan.plot("plan.png")
    picture(plan).stages[0].layers[0].weights   # what the first box shows
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from distgraph.errors import DistGraphError
from distgraph.mesh import ProcessMesh
from distgraph.placement import ShardSpec
from distgraph.plan.kinds import StepKind
from distgraph.units import fmt_bytes

ROLES = {"forward": "fwd", "loss": "fwd", "backward": "bwd", "optimize": "update"}
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")


@dataclass(frozen=True)
class WeightView:
    """A parameter as drawn: its name inside the layer, shape and how it is laid out."""

    name: str
    shape: tuple
    mesh: ProcessMesh
    spec: ShardSpec
    gathered: tuple = ()    # mesh dims whose split is all-gathered before the forward
    batch: tuple = ()       # mesh dims that split the samples its forward op computes on

    def splits(self) -> list:
        """(mesh dim, what it does) per mesh dim of size > 1: ``columns``, ``rows``,
        ``dim k``, ``copies`` (replicated over it) or ``partial``; a split all-gathered
        before use (ZeRO-3 style) says so: the processes compute on the whole weight and
        only store it split."""
        out = []
        for dim in self.mesh.dim_names:
            if self.mesh.dim_size(dim) == 1:
                continue
            what = "copies"
            for k in range(len(self.shape)):
                if dim in self.spec.entry(k):
                    what = _axis_name(k, len(self.shape))
            if dim in self.spec.partial:
                what = "partial"
            elif what != "copies" and dim in self.gathered:
                what = f"{what} stored, gathered to use"
            out.append((dim, what))
        return out


@dataclass(frozen=True)
class LayerView:
    """A layer (``blocks.3``, ``wte``): its weight matrices (its vectors too when it has
    no matrix), how many vectors are left out and how many of those are split, and the
    reshards inserted in it per role: (role, count, bytes, step kinds)."""

    name: str
    weights: tuple
    vectors: tuple          # (left out, of which split)
    reshards: tuple


@dataclass(frozen=True)
class StageView:
    """A stage: its mesh, its layers, and ``batch``: the mesh dims its processes split
    the batch over (each computes on its share of the samples; empty: whole)."""

    index: int
    mesh: ProcessMesh
    layers: tuple
    batch: tuple = ()


@dataclass(frozen=True)
class Crossing:
    """What crosses from stage ``src`` to stage ``dst`` per occurrence: ``count``
    reshards of ``bytes`` in all, in the forward (``fwd``) or backward (``bwd``)."""

    src: int
    dst: int
    role: str
    count: int
    bytes: float


@dataclass(frozen=True)
class Picture:
    title: str
    stages: tuple
    crossings: tuple
    mesh_dims: tuple


def _axis_name(k: int, ndim: int) -> str:
    if ndim >= 2 and k == ndim - 1:
        return "columns"
    if ndim >= 2 and k == ndim - 2:
        return "rows"
    return "split" if ndim == 1 else f"dim {k}"


def layer_of(path: str) -> str:
    """The layer a parameter or op path belongs to: up to its first index
    (``blocks.3.attn.qkv`` -> ``blocks.3``), else its first part (``wte.weight`` ->
    ``wte``); "" for ops of the model itself."""
    parts = path.split(".") if path else []
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0] if parts else ""


def picture(plan) -> Picture:
    """The plan summarised for drawing: stages with their layers, weights and reshards,
    and what crosses between stages."""
    program = plan.program
    stages = list(plan.stages)
    points = plan.reshards() if plan.distributed else []
    gathered: dict = {}          # parameter -> mesh dims gathered before the forward uses it
    for point in points:
        op = program.ops[point.anchor] if 0 <= point.anchor < len(program.ops) else None
        if op is None or ROLES.get(op.role) != "fwd":
            continue
        for s in point.steps:
            if s.kind is StepKind.ALL_GATHER:
                gathered.setdefault(point.value, set()).add(s.mesh_dim)
    stage_batch, param_batch = _batch_dims(program, stages)
    layers: dict = {}                        # layer -> [weights], in parameter order
    stage_of: dict = {}
    for v in program.parameters:
        name = layer_of(v.name)
        layers.setdefault(name, []).append(
            WeightView(v.name[len(name) + 1:], tuple(v.shape), v.dist_attr.mesh,
                       v.dist_attr.spec, tuple(sorted(gathered.get(v.name, ()))),
                       tuple(param_batch.get(v.name, ()))))
        stage_of.setdefault(name, _stage_index(stages, v.dist_attr.mesh))
    reshards: dict = {name: Counter() for name in layers}
    sizes: dict = {}
    crossings: Counter = Counter()
    cross_bytes: Counter = Counter()
    order = list(layers)
    for point in points:
        op = program.ops[point.anchor] if 0 <= point.anchor < len(program.ops) else None
        role = ROLES.get(op.role, op.role) if op is not None else "update"
        send = next((s for s in point.steps if s.kind is StepKind.SEND_RECV), None)
        if send is not None:
            key = (_stage_index(stages, send.mesh), _stage_index(stages, send.dst_mesh), role)
            crossings[key] += 1
            cross_bytes[key] += point.bytes
            continue
        if not point.steps:
            continue
        name = layer_of(op.layer) if op is not None and op.layer else ""
        if name not in reshards:           # ops of the model itself: the nearest layer
            name = _nearest(order, program, point.anchor)
        if name not in reshards:           # a model without parameters: nowhere to draw it
            continue
        steps = " + ".join(f"{s.kind}·{s.mesh_dim}" if s.mesh_dim else s.kind
                           for s in point.steps)
        key = (role, steps)
        reshards[name][key] += 1
        sizes[name, key] = sizes.get((name, key), 0.0) + point.bytes
    views = []
    for s, mesh in enumerate(stages):
        mine = [_layer_view(name, layers[name], reshards[name], sizes)
                for name in order if stage_of[name] == s]
        views.append(StageView(s, mesh, tuple(mine), tuple(stage_batch.get(s, ()))))
    dims = []
    for mesh in stages:
        dims += [d for d in mesh.dim_names if d not in dims]
    title = (f"{plan.world_size} process{'es' * (plan.world_size > 1)}, {len(stages)} "
             f"stage{'s' * (len(stages) > 1)}"
             + (f", {plan.micro_batches} micro-batches ({plan.strategy.schedule}): fwd/bwd "
                f"reshards run once per micro-batch" if plan.micro_batches > 1 else ""))
    return Picture(title, tuple(views),
                   tuple(Crossing(a, b, role, n, cross_bytes[a, b, role])
                         for (a, b, role), n in sorted(crossings.items())),
                   tuple(dims))


def _batch_dims(program, stages) -> tuple:
    """({stage index: mesh dims}, {parameter: mesh dims}) that split the batch: the mesh
    dims of the leading (sample) dim of the forward values that carry samples (the
    feeds, and what forward ops make from them with the batch's leading size), by the
    stage whose mesh holds them; for a parameter, those of the result of the first
    forward op that computes with it (through casts), where that result carries samples."""
    feeds = [v for v in program.inputs if v.shape]
    by_stage: dict = {}
    by_param: dict = {}
    if not feeds:
        return by_stage, by_param
    rows = feeds[0].shape[0]
    carrying = {v.name for v in feeds}
    via: dict = {}                    # a parameter's cast -> the parameter

    def dims(v) -> list:
        attr = v.dist_attr
        return [] if attr is None else \
            [d for d in attr.spec.entry(0) if attr.mesh.dim_size(d) > 1]

    def note(v):
        if v.dist_attr is not None:
            mine = by_stage.setdefault(_stage_index(stages, v.dist_attr.mesh), [])
            mine += [d for d in dims(v) if d not in mine]

    for v in feeds:
        note(v)
    for op in program.ops:
        if op.role not in ("forward", "loss"):
            continue
        params = [via.get(v.name, v.name) for v in op.inputs
                  if v.is_parameter or v.name in via]
        if op.type == "cast" and params:
            via[op.outputs[0].name] = params[0]
            continue
        if any(v.name in carrying for v in op.inputs):
            for v in op.outputs:
                if v.shape and v.shape[0] == rows:
                    carrying.add(v.name)
                    note(v)
            for name in params:
                by_param.setdefault(name, dims(op.outputs[0])
                                    if op.outputs[0].name in carrying else [])
    return by_stage, by_param


def _layer_view(name, weights, reshards: Counter, sizes) -> LayerView:
    matrices = tuple(w for w in weights if len(w.shape) >= 2)
    vectors = [w for w in weights if len(w.shape) < 2]
    left = (len(vectors), sum(1 for w in vectors if w.spec.mesh_dims())) if matrices else (0, 0)
    per_role: dict = {}
    for (role, steps), n in reshards.items():
        count, size, kinds = per_role.get(role, (0, 0.0, []))
        kinds = kinds + [k for k in steps.split(" + ") if k not in kinds]
        per_role[role] = (count + n, size + sizes[name, (role, steps)], kinds)
    rows = tuple((role, *per_role[role][:2], tuple(per_role[role][2]))
                 for role in ("fwd", "bwd", "update") if role in per_role)
    return LayerView(name, matrices or tuple(vectors), left, rows)


def _stage_index(stages, mesh) -> int:
    if mesh in stages:
        return stages.index(mesh)
    ids = set(mesh.process_ids)
    for i, m in enumerate(stages):        # a sub-mesh of a stage
        if ids <= set(m.process_ids):
            return i
    return 0


def _nearest(order, program, anchor) -> str:
    """The last layer with weights used at or before op ``anchor`` (the first layer when
    none is)."""
    best = order[0] if order else ""
    for op in program.ops[:anchor + 1]:
        name = layer_of(op.layer) if op.layer else ""
        if name in order:
            best = name
    return best


# -- drawing ---------------------------------------------------------------------------------
COL_W, GAP = 4.6, 0.9             # inches: a stage column and the space between two
HEADER = 1.45                     # the stage's title and mesh grid
ROW, LINE, TITLE = 0.52, 0.2, 0.3


def _layer_height(layer: LayerView) -> float:
    lines = len(layer.reshards) + (1 if layer.vectors[0] else 0)
    return TITLE + ROW * len(layer.weights) + LINE * lines + 0.15


def plot_plan(plan, path) -> None:
    """Draw :func:`picture` of ``plan`` into ``path`` (PNG, SVG, PDF by its suffix)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle
    except ImportError:
        raise DistGraphError("Plan.plot needs matplotlib: pip install 'distgraph[plot]' (or "
                             "pip install matplotlib); Plan.explain() prints the same as "
                             "text") from None
    pic = picture(plan)
    colors = {d: PALETTE[i % len(PALETTE)] for i, d in enumerate(pic.mesh_dims)}
    n = len(pic.stages)
    width = max(n * COL_W + (n - 1) * GAP + 0.4, 7.5)
    body = max((sum(_layer_height(x) + 0.15 for x in s.layers) for s in pic.stages), default=1)
    height = 0.7 + HEADER + body + 1.0
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    ax.text(0.2, 0.35, f"Plan: {pic.title}", fontsize=12, weight="bold", va="center")
    for s in pic.stages:
        x0 = 0.2 + s.index * (COL_W + GAP)
        ax.add_patch(FancyBboxPatch((x0, 0.65), COL_W, height - 1.7, boxstyle="round,pad=0.02",
                                    facecolor="#f6f6f6", edgecolor="#bbbbbb"))
        _mesh(ax, s, x0 + 0.15, 0.8, colors, Rectangle)
        y = 0.7 + HEADER
        for layer in s.layers:
            y = _layer(ax, layer, x0 + 0.1, y, colors, Rectangle, FancyBboxPatch) + 0.15
    for c in pic.crossings:
        _crossing(ax, c, FancyArrowPatch)
    y = height - 0.5
    ax.text(0.2, y, "split over:", fontsize=8, va="center")
    x = 1.0
    for d in pic.mesh_dims:
        ax.add_patch(Rectangle((x, y - 0.07), 0.25, 0.14, facecolor=colors[d], edgecolor="none"))
        ax.text(x + 0.32, y, d, fontsize=8, va="center")
        x += 0.4 + 0.08 * len(d)
    ax.text(x + 0.3, y, "grey shadow: copies over a mesh dim", fontsize=8, va="center",
            color="#333333")
    ax.text(0.2, y + 0.25, "red: reshards (count, bytes a process sends, steps with their "
            "mesh dim); arrows: what crosses between stages", fontsize=8, va="center",
            color="#b22222")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _mesh(ax, stage, x, y, colors, Rectangle) -> None:
    mesh = stage.mesh
    shape = mesh.shape if len(mesh.shape) == 2 else (1, len(mesh.process_ids))
    ids = list(mesh.process_ids)
    names = list(mesh.dim_names)
    ax.text(x, y + 0.05, f"stage {stage.index}", fontsize=11, weight="bold", va="center")
    ax.text(x, y + 0.32, "mesh " + " x ".join(f"{d}={mesh.dim_size(d)}" for d in names),
            fontsize=8, va="center", color="#333333")
    ax.text(x, y + 0.56, ("batch split over " + " x ".join(stage.batch)) if stage.batch
            else "batch whole on each process", fontsize=8, va="center", weight="bold",
            color=colors.get(stage.batch[0], "black") if stage.batch else "#333333")
    cell, gx, gy = 0.3, x + 2.2, y + 0.3
    rows, cols = shape
    for r in range(rows):
        for c in range(cols):
            ax.add_patch(Rectangle((gx + c * cell, gy + r * cell), cell, cell,
                                   facecolor="white", edgecolor="#555555", linewidth=0.8))
            ax.text(gx + (c + 0.5) * cell, gy + (r + 0.5) * cell, str(ids[r * cols + c]),
                    fontsize=7, ha="center", va="center")
    if len(mesh.shape) == 2:
        ax.annotate("", (gx - 0.08, gy + rows * cell), (gx - 0.08, gy),
                    arrowprops=dict(arrowstyle="->", color=colors[names[0]], lw=1.5))
        ax.text(gx - 0.15, gy + rows * cell / 2, names[0], fontsize=8, ha="right",
                va="center", color=colors[names[0]], weight="bold")
        ax.annotate("", (gx + cols * cell, gy - 0.08), (gx, gy - 0.08),
                    arrowprops=dict(arrowstyle="->", color=colors[names[1]], lw=1.5))
        ax.text(gx + cols * cell + 0.08, gy - 0.08, names[1], fontsize=8, va="center",
                color=colors[names[1]], weight="bold")
    else:
        ax.text(gx + cols * cell + 0.08, gy + cell / 2, " x ".join(names), fontsize=8,
                va="center", color=colors[names[0]], weight="bold")


def _layer(ax, layer, x, y, colors, Rectangle, FancyBboxPatch) -> float:
    h = _layer_height(layer)
    ax.add_patch(FancyBboxPatch((x, y), COL_W - 0.2, h, boxstyle="round,pad=0.02",
                                facecolor="white", edgecolor="#888888"))
    ax.text(x + 0.1, y + 0.17, layer.name or "(model)", fontsize=9, weight="bold",
            va="center")

    row = y + TITLE
    for w in layer.weights:
        _weight(ax, w, x + 0.15, row, colors, Rectangle)
        row += ROW
    if layer.vectors[0]:
        count, split = layer.vectors
        ax.text(x + 0.15, row + LINE / 2, f"+ {count} vectors (biases, norms)"
                + (f", {split} of them split" if split else ", whole"), fontsize=7,
                va="center", color="#555555")
        row += LINE
    for role, count, size, kinds in layer.reshards:
        ax.text(x + 0.15, row + LINE / 2, f"{role}: {count} reshard{'s' * (count > 1)}, "
                f"{fmt_bytes(size)}  ({', '.join(kinds)})", fontsize=7, va="center",
                color="#b22222")
        row += LINE
    return y + h


def _weight(ax, w: WeightView, x, y, colors, Rectangle) -> None:
    nd = len(w.shape)
    bw, bh = 0.5, (0.36 if nd >= 2 else 0.14)       # a matrix, or a vector as a bar
    top = y + 0.06 + (0.36 - bh) / 2
    copies = any(what == "copies" for _, what in w.splits())
    if copies:        # a shadow: the weight has copies over some mesh dim
        ax.add_patch(Rectangle((x + 0.06, top - 0.04), bw, bh, facecolor="#dddddd",
                               edgecolor="#999999", linewidth=0.6))
    ax.add_patch(Rectangle((x, top), bw, bh, facecolor="#fafafa", edgecolor="#333333",
                           linewidth=0.8))
    for k in range(nd):
        entry = w.spec.entry(k)
        parts = 1
        for d in entry:
            parts *= w.mesh.dim_size(d)
        if parts == 1:
            continue
        color = colors.get(entry[0], "black")
        columns = nd == 1 or k == nd - 1
        for i in range(1, parts):
            if columns:
                xs = x + bw * i / parts
                ax.plot([xs, xs], [top, top + bh], color=color, lw=1.6)
            else:
                ys = top + bh * i / parts
                ax.plot([x, x + bw], [ys, ys], color=color, lw=1.6)
    ax.text(x + bw + 0.2, y + 0.14, f"{w.name} {list(w.shape)}", fontsize=8, va="center")
    ax.text(x + bw + 0.35 + 0.075 * len(f"{w.name} {list(w.shape)}"), y + 0.14,
            ("on the batch split over " + " x ".join(w.batch)) if w.batch
            else "on the whole batch", fontsize=7, va="center",
            color=colors.get(w.batch[0], "black") if w.batch else "#555555")
    tx = x + bw + 0.2
    for dim, what in w.splits():
        label = f"{dim}: {what}"
        ax.text(tx, y + 0.36, label, fontsize=7, va="center",
                color=colors.get(dim, "black") if what != "copies" else "#777777")
        tx += 0.075 * len(label) + 0.15


def _crossing(ax, c: Crossing, FancyArrowPatch) -> None:
    left = 0.2 + min(c.src, c.dst) * (COL_W + GAP) + COL_W
    right = 0.2 + max(c.src, c.dst) * (COL_W + GAP)
    y = 1.0 if c.dst > c.src else 1.6          # activations above, gradients below
    start, end = (left, right) if c.dst > c.src else (right, left)
    ax.add_patch(FancyArrowPatch((start, y), (end, y), arrowstyle="-|>", mutation_scale=12,
                                 color="#b22222", lw=1.3))
    what = "activations" if c.role == "fwd" else "gradients" if c.role == "bwd" else c.role
    what = what if c.count > 1 or what[-1] != "s" else what[:-1]
    ax.text((start + end) / 2, y - 0.06, f"{c.count} {what}\n{fmt_bytes(c.bytes)}",
            fontsize=7, ha="center", va="bottom", color="#b22222", linespacing=1.1)
