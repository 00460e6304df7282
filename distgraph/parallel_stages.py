"""The pipeline split of :func:`distgraph.parallelize.parallelize` (``pp_config``): which stage
mesh each layer of a model runs on.

``split_spec`` names a layer list (``"blocks"``, ``"layers"``) split evenly over the ``pp``
dim (item i on stage ``i * P // n``), or gives split points (``{path: dg.SplitPoint.END |
BEGINNING}`` as Paddle writes them, or ``{path: s}``: stage s begins at that layer); the
embedding goes with the first stage, the final norm and head with the last. Stage s runs on
``mesh.get_mesh_with_dim("pp", s)``.

Example::

    stages = Stages(model, mesh, "blocks")
    stages.mesh_of("blocks.3.mlp")       # the stage mesh of that layer
"""

from __future__ import annotations

from distgraph.errors import DistGraphError
from distgraph.keywords import suggest
from distgraph.mesh import ProcessMesh
from distgraph.parallel_styles import SplitPoint

class Stages:
    """Which stage each layer and parameter of ``model`` goes to, and the stage meshes
    (the slices of ``pp``; the mesh itself without one). The model's layers and
    parameters in order (each layer before its content) are cut where stages begin."""

    def __init__(self, model, mesh, split_spec):
        self.order = list(_walk(model))
        self.index = {path: i for i, (path, _) in enumerate(self.order)}
        self.meshes = _stage_meshes(mesh)
        self.cuts = _cuts(self, model, split_spec, len(self.meshes)) \
            if split_spec is not None else []

    def stage_of(self, path: str) -> int:
        i = self.index[path]
        return sum(1 for c in self.cuts if c <= i)

    def mesh_of(self, path: str) -> ProcessMesh:
        return self.meshes[self.stage_of(path)]

    def end_of(self, path: str) -> int:
        """The position after ``path`` and everything inside it."""
        i = self.index[path]
        j = i + 1
        while j < len(self.order) and self.order[j][0].startswith(path + "."):
            j += 1
        return j


def _walk(layer, prefix=""):
    """(path, layer or parameter) of ``layer``'s sub-layers and parameters in order, each
    layer before its content, each parameter once (at its first path)."""
    seen = set()

    def walk(node, at):
        for name, p in node._parameters.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                yield (f"{at}.{name}" if at else name), p
        for name, sub in node._sublayers.items():
            path = f"{at}.{name}" if at else name
            yield path, sub
            yield from walk(sub, path)

    yield from walk(layer, prefix)


def _stage_meshes(mesh) -> list:
    if "pp" not in mesh.dim_names:
        return [mesh]
    n = mesh.dim_size("pp")
    if mesh.ndim == 1:
        return [ProcessMesh([pid], ["pp"]) for pid in mesh.process_ids]
    return [mesh.get_mesh_with_dim("pp", s) for s in range(n)]


def _cuts(stages, model, spec, n) -> list:
    """The positions (in ``stages.order``) where stages 1 .. n-1 begin."""
    if isinstance(spec, str):
        items = _layer_list(stages, spec)
        if len(items) < n:
            raise DistGraphError(f"parallelize: pp_config split_spec {spec!r} has {len(items)} "
                                 f"layers for {n} stages of the pp dim; split a longer list or "
                                 f"use fewer stages")
        firsts = [next(i for i in range(len(items)) if i * n // len(items) == s)
                  for s in range(1, n)]
        return [stages.index[f"{spec}.{i}"] for i in firsts]
    if not isinstance(spec, dict) or not spec:
        raise DistGraphError(f"parallelize: pp_config split_spec must name a layer list (e.g. "
                             f"'blocks' or 'layers') or be a dict of split points {{layer path: "
                             f"dg.SplitPoint.END}}, got {spec!r}")
    points = []                     # (position where a stage begins, its stage or None)
    zero = None                     # where a {path: 0} says stage 0 begins
    for path, point in spec.items():
        if path not in stages.index or not hasattr(stages.order[stages.index[path]][1],
                                                    "_sublayers"):
            raise DistGraphError(f"parallelize: pp_config split_spec names {path!r}, which is "
                                 f"not a layer of {type(model).__name__}"
                                 f"{suggest(path, stages.index)}")
        if point is SplitPoint.END:
            points.append((stages.end_of(path), None))
        elif point is SplitPoint.BEGINNING:
            points.append((stages.index[path], None))
        elif isinstance(point, int) and not isinstance(point, bool) and 0 < point < n:
            points.append((stages.index[path], point))
        elif isinstance(point, int) and not isinstance(point, bool) and point == 0:
            zero = stages.index[path]
        else:
            raise DistGraphError(f"parallelize: pp_config split_spec[{path!r}] = {point!r}; give "
                                 f"dg.SplitPoint.END, dg.SplitPoint.BEGINNING or a stage index "
                                 f"in 0..{n - 1} (the stage that begins at that layer)")
    points.sort()
    numbered = [at for at, _ in points]
    if len(points) != n - 1 or any(s not in (None, k + 1) for k, (_, s) in enumerate(points)) \
            or (zero is not None and points and zero > points[0][0]):
        raise DistGraphError(f"parallelize: pp_config split_spec {_show(spec)} gives "
                             f"{len(points)} split point(s) for the {n} stages of the pp dim; "
                             f"give {n - 1}, in the model's order (a stage index says which "
                             f"stage begins there: 1 .. {n - 1} in order)")
    cuts = numbered
    params = [i for i, (_, x) in enumerate(stages.order) if not hasattr(x, "_sublayers")]
    bounds = [0] + cuts + [len(stages.order)]
    for s in range(n):
        if bounds[s] >= bounds[s + 1] or not any(bounds[s] <= i < bounds[s + 1] for i in params):
            raise DistGraphError(f"parallelize: pp_config split_spec {_show(spec)} leaves stage "
                                 f"{s} without a parameter; move its split points")
    return cuts


def _layer_list(stages, path) -> list:
    found = stages.order[stages.index[path]][1] if path in stages.index else None
    if found is None or not hasattr(found, "_items"):
        lists = [p for p, x in stages.order if hasattr(x, "_items")]
        raise DistGraphError(f"parallelize: pp_config split_spec {path!r} is not a layer list "
                             f"of the model; its layer lists: {lists or 'none'}")
    return list(found)


def _show(spec) -> str:
    """A split_spec dict as it is written: ``{'blocks.0': dg.SplitPoint.END}``."""
    return "{" + ", ".join(f"{k!r}: " + (f"dg.{v}" if isinstance(v, SplitPoint) else repr(v))
                           for k, v in spec.items()) + "}"


# -- tensor parallelism ----------------------------------------------------------------------
