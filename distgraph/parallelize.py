"""``dg.parallelize``: a data x tensor x pipeline layout in one call (Paddle 3.x's
intermediate API, ``paddle.distributed.parallelize``).

::

    mesh = dg.ProcessMesh(np.arange(8).reshape(2, 2, 2).tolist(), ["pp", "dp", "mp"])
    model, optimizer = dg.parallelize(model, mesh, {
        "dp_config": {"sharding_level": 2},
        "mp_config": {"parallelize_plan": "megatron"},
        "pp_config": {"split_spec": "blocks"},
    }, optimizer=dg.optim.AdamW(1e-3))

**The mesh.** Its dims are named among ``dp`` (data parallel), ``pp`` (pipeline), ``mp``
(tensor parallel), ``cp`` (context parallel) and ``ep`` (expert parallel). The slices of
``pp`` are the stage meshes: stage s runs on ``mesh.get_mesh_with_dim("pp", s)``, the
sub-mesh of the other dims (a mesh of ``pp`` alone: one process per stage,
``ProcessMesh([p], ["pp"])``), and every stage is laid out alike on its slice. A dim of
size > 1 that the config gives nothing to do is an error, not a silent copy.

**The config** (every key optional; an unknown key is an error):

- ``dp_config: {"sharding_level": 0-3}``: the batch is split over ``dp`` in any case
  (below). Paddle's ZeRO levels map onto what distgraph has:

  - 0: plain data parallelism: gradients all-reduced, states whole.
  - 1 and 2: the optimizer's states and updates split over ``dp``
    (``Strategy(sharding=True)``, :mod:`distgraph.passes.transforms.zero`, whatever the
    shapes: a tensor no dim of which ``dp`` divides is padded with zeros to be split
    evenly): each process updates its slice of a parameter, whose gradient is
    reduce-scattered onto that slice rather than all-reduced, and the updated slices are
    all-gathered back. That is level 2 (ZeRO-2: states and gradients). Level 1 is the same
    plan: Paddle's level 1 all-reduces the gradient and keeps it whole, which here would
    move twice the gradient's bytes (an all-reduce is a reduce-scatter and an all-gather) to
    hold a whole gradient that no update reads; what level 1 asks for, states split over
    ``dp``, it has.
  - 3: also the parameters, stored split over ``dp`` on their first dim that ``dp``
    divides (on top of their tensor-parallel split), and read whole over ``dp`` by the
    ops of the layer that owns them (ZeRO-3, FSDP: each weight all-gathered where it is
    used, in the forward and again in the backward; its gradient reduce-scattered onto
    its slice; the batch stays split). The reads are pinned (the layer's forward runs
    under an op annotation, as ``shard_op``'s in_shard_specs): completion, which prices
    bytes moved and not work, would otherwise gather the small token batch instead and
    compute the whole batch on every process. A parameter with no such dim is stored
    split by the planner (:mod:`distgraph.passes.transforms.zero`): padded with zeros
    along the dim needing the least, or over a dim split over ``mp`` and ``dp`` together
    where their product divides it, and read whole where it is used; one read outside
    its layer (GPT's ``wpe``, a tied head) is read as completion chooses.

  The level reaches the planner on the optimizer, as Paddle wraps it: ``parallelize``
  returns the optimizer it is given with ``optimizer.sharding_level`` set; the program
  built with it records the level (``BuiltProgram.sharding_level``) and the planner
  plans it with ``Strategy(sharding=True)`` over ``dp``. Levels 1-3 need the optimizer.

- ``mp_config: {"parallelize_plan": plan}``: ``plan`` is a dict of patterns to styles
  (:mod:`distgraph.parallel_styles`), or a list of styles each, or ``"megatron"``: the
  model's own Megatron-LM plan (``model.megatron(mesh, "mp")``: ``dg.nn.GPT``,
  ``Llama``, ``Mixtral``). A pattern is matched against every layer path
  (``named_sublayers``, e.g. ``"blocks.*.mlp.fc1"``) and parameter path
  (``named_parameters``, e.g. ``"lm_head.weight"``), one dotted component at a time
  with ``fnmatch`` (``*`` and ``[qkv]`` stay within a component: ``"blocks.*.ln*"``
  matches ``blocks.0.ln1``, not ``blocks.0.ln1.weight``); one that matches nothing is an
  error.
- ``pp_config: {"split_spec": spec}``: ``spec`` names a layer list (``"blocks"``,
  ``"layers"``), whose items are split evenly over the ``pp`` dim (item i on stage
  ``i * P // n``), or is a dict of split points: ``{layer path: dg.SplitPoint.END}``
  (a stage ends after that layer), ``dg.SplitPoint.BEGINNING`` (one begins at it), or
  ``{layer path: s}`` (stage s begins at it). What comes before the first split (the
  embedding) goes with the first stage, what comes after the last (the final norm and
  head) with the last; the order is the model's (its layers as registered).

**What it annotates.** Every parameter, with ``shard_tensor`` on its stage's mesh (an
annotation made before is replaced; annotate after it to change one), which places the
stages: pipeline stages follow the data flow from parameter annotations. The batch:
each input of the model's forward is split over ``dp`` (and ``ep``) on dim 0, and over
``cp`` on dim 1, on the first stage, unless the data come from ``dg.shard_dataloader``,
whose split is kept: ``engine.fit(dataset)`` trains data parallel as it stands, and
``dg.shard_dataloader(data, [first stage, last stage], "dp")`` also reads each label
on its own processes only, and with ``sequence_dim="cp"`` stores sequences in the
load-balanced order (the split made here keeps the natural order). A style that lays out
activations wraps its layer's forward. Everything else (micro-batches, the schedule,
recompute, amp, ``sequence_parallel``) stays in ``dg.Strategy``.

Returns the model, or ``(model, optimizer)`` when an optimizer is given (Paddle's).
"""

from __future__ import annotations

import fnmatch
import functools

from distgraph import ops
from distgraph.annotation import OpAnnotation, shard_tensor, to_shard_spec
from distgraph.errors import DistGraphError
from distgraph.ir import Value
from distgraph.mesh import ProcessMesh
from distgraph.optim import Optimizer
from distgraph.parallel_styles import (FEATURES, SEQUENCE, ColWiseParallel, ParallelStyle,
                                       RowWiseParallel)
from distgraph.keywords import suggest
from distgraph.parallel_stages import Stages
from distgraph.placement import ShardSpec
from distgraph.trace import active_builder

MESH_DIMS = ("dp", "pp", "mp", "cp", "ep")
CONFIG_KEYS = {"dp_config": ("sharding_level",), "mp_config": ("parallelize_plan",),
               "pp_config": ("split_spec",)}
BUILT_IN_PLANS = ("megatron",)
BATCH_DIMS = ("dp", "ep")          # the mesh dims that split the batch
WRAPPED = "_parallelize_forward"   # a layer's own forward, kept where parallelize wraps it


def parallelize(model, mesh, config=None, optimizer=None):
    """Lay ``model`` out over ``mesh`` as ``config`` says (module docstring); returns the
    model, or ``(model, optimizer)`` when ``optimizer`` is given.

    Example::

        mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
        model = dg.parallelize(model, mesh, {"mp_config": {"parallelize_plan": "megatron"}})
    """
    config = _checked_config(config)
    _check_mesh(mesh, config)
    level = config.get("dp_config", {}).get("sharding_level", 0)
    _check_level(level, mesh, optimizer)
    model.assign_paths()            # errors name a parameter by its path in the model
    stages = Stages(model, mesh, config.get("pp_config", {}).get("split_spec"))
    params = model.named_parameters()
    before = [p.annotation for _, p in params]
    try:
        wraps, gathered = _annotate(model, stages,
                                    config.get("mp_config", {}).get("parallelize_plan"), level,
                                    "ep" in mesh.dim_names)
    except DistGraphError:
        for (_, p), annotation in zip(params, before):    # as it was
            p.annotation = annotation
        raise
    _unwrap(model)
    layers = dict(model.named_sublayers())
    for path in sorted(set(wraps) | set(gathered)):
        styles = wraps[path][1] if path in wraps else []
        _wrap(layers[path], stages.mesh_of(path), styles, path, gathered.get(path, {}))
    _wrap_inputs(model, stages.meshes[0])
    if optimizer is None:
        return model
    optimizer.sharding_level = level
    return model, optimizer


def _annotate(model, stages, plan, level, experts) -> tuple:
    """Annotate every parameter of ``model`` on its stage's mesh; returns the layers
    whose activations the plan lays out ({path: (layer, styles)}) and, with level 3, the
    layers whose parameters their ops read gathered over dp ({path: {parameter's name
    in the layer: the spec read}})."""
    for _, p in model.named_parameters():
        p.annotation = None
    template = stages.meshes[0]     # every stage alike: the specs are made on stage 0's
    wraps = _tensor_parallel(model, template, plan) if plan is not None else {}
    specs = {name: p.annotation.spec if p.annotation is not None else
             ShardSpec.replicated(len(p.shape)) for name, p in model.named_parameters()}
    if experts:
        _split_experts(model, specs, template)
    gathered = {}
    if level == 3:
        used = dict(specs)
        _split_over_dp(model, specs, template)
        for path, layer in model.named_sublayers():
            for leaf in layer._parameters:
                name = f"{path}.{leaf}"          # not in specs: a tied parameter's 2nd path
                if name in specs and specs[name] != used[name]:
                    gathered.setdefault(path, {})[leaf] = used[name]
    for name, p in model.named_parameters():
        p.annotation = None
        shard_tensor(p, stages.mesh_of(name), specs[name])
    return wraps, gathered


# -- the config and the mesh -----------------------------------------------------------------

def _checked_config(config) -> dict:
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise DistGraphError(f"parallelize: config must be a dict with keys among "
                             f"{', '.join(CONFIG_KEYS)}, got {type(config).__name__}")
    for key, value in config.items():
        if key not in CONFIG_KEYS:
            raise DistGraphError(f"parallelize: config key {key!r} is not one it knows"
                                 f"{suggest(key, CONFIG_KEYS, 1)}; give {', '.join(map(repr, CONFIG_KEYS))} (micro-batches, "
                                 f"schedule, recompute and amp are dg.Strategy's)")
        if not isinstance(value, dict):
            raise DistGraphError(f"parallelize: config[{key!r}] must be a dict, e.g. "
                                 f"{{{CONFIG_KEYS[key][0]!r}: ...}}, got {value!r}")
        for inner in value:
            if inner not in CONFIG_KEYS[key]:
                raise DistGraphError(f"parallelize: config[{key!r}] key {inner!r} is not one "
                                     f"it knows{suggest(inner, CONFIG_KEYS[key], 1)}; give {', '.join(map(repr, CONFIG_KEYS[key]))}")
    for key, inner in (("mp_config", "parallelize_plan"), ("pp_config", "split_spec")):
        if key in config and config[key].get(inner) is None:
            raise DistGraphError(f"parallelize: config[{key!r}] needs {inner!r}")
    return config


def _check_mesh(mesh, config) -> None:
    if not isinstance(mesh, ProcessMesh):
        raise DistGraphError(f"parallelize: mesh must be a ProcessMesh with dims named among "
                             f"{', '.join(MESH_DIMS)}, got {type(mesh).__name__}")
    for dim in mesh.dim_names:
        if dim not in MESH_DIMS:
            raise DistGraphError(f"parallelize: mesh dim {dim!r} of {mesh} is not one it "
                                 f"knows; name the dims among {', '.join(MESH_DIMS)} "
                                 f"(Paddle's: tensor parallel is 'mp')")
    for dim, key, what in (("mp", "mp_config", "{'parallelize_plan': ...}"),
                           ("pp", "pp_config", "{'split_spec': ...}")):
        present = dim in mesh.dim_names
        if present and mesh.dim_size(dim) > 1 and key not in config:
            raise DistGraphError(f"parallelize: mesh dim {dim!r} of {mesh} splits nothing: "
                                 f"give config[{key!r}] = {what}, or leave the dim out")
        if key in config and not present:
            raise DistGraphError(f"parallelize: config[{key!r}] splits over mesh dim "
                                 f"{dim!r}, which {mesh} lacks; add it to the mesh")


def _check_level(level, mesh, optimizer) -> None:
    if isinstance(level, bool) or level not in (0, 1, 2, 3):
        raise DistGraphError(f"parallelize: dp_config sharding_level {level!r}; give 0 (none), "
                             f"1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)")
    if level and not ("dp" in mesh.dim_names and mesh.dim_size("dp") > 1):
        raise DistGraphError(f"parallelize: dp_config sharding_level {level} shards over mesh "
                             f"dim 'dp', but {mesh} has no dp dim of size > 1")
    if optimizer is not None and not isinstance(optimizer, Optimizer):
        raise DistGraphError(f"parallelize: optimizer must be a dg.optim optimizer (e.g. "
                             f"dg.optim.AdamW(1e-3)), got {type(optimizer).__name__}")
    if level and optimizer is None:
        raise DistGraphError(f"parallelize: dp_config sharding_level {level} shards the "
                             f"optimizer's states: pass optimizer=... (parallelize returns it "
                             f"carrying the level, as Paddle wraps it)")


# -- pipeline stages -------------------------------------------------------------------------

def _tensor_parallel(model, mesh, plan) -> dict:
    """Annotate the parameters of ``plan`` on ``mesh`` (stage 0's); returns {layer path:
    (layer, styles)} of the layers whose activations a style lays out."""
    if isinstance(plan, str):
        if plan not in BUILT_IN_PLANS:
            raise DistGraphError(f"parallelize: mp_config parallelize_plan {plan!r} is not a "
                                 f"built-in plan; give {', '.join(map(repr, BUILT_IN_PLANS))} or "
                                 f"a dict of layer patterns to styles")
        built_in = getattr(model, "megatron", None)
        if not callable(built_in):
            raise DistGraphError(f"parallelize: mp_config parallelize_plan 'megatron' is the "
                                 f"built-in plan of dg.nn's GPT, Llama and Mixtral; "
                                 f"{type(model).__name__} has none (no megatron(mesh, dim) "
                                 f"method): give a dict of layer patterns to styles, e.g. "
                                 f"{{'blocks.*.mlp.fc1': dg.ColWiseParallel()}}")
        built_in(mesh, "mp")
        return {}
    if not isinstance(plan, dict):
        raise DistGraphError(f"parallelize: mp_config parallelize_plan must be a dict of layer "
                             f"patterns to styles or 'megatron', got {plan!r}")
    layers = dict(model.named_sublayers())
    params = dict(model.named_parameters())
    owners = {}                       # parameter path -> (pattern, style) that split it
    wraps = {}
    for pattern, given in plan.items():
        styles = _styles(pattern, given)
        hit_layers = [p for p in layers if matches(pattern, p)]
        hit_params = [p for p in params if matches(pattern, p)]
        if not hit_layers and not hit_params:
            raise DistGraphError(f"parallelize: mp_config parallelize_plan pattern {pattern!r} "
                                 f"matches no layer or parameter of {type(model).__name__}"
                                 f"{suggest(pattern, list(layers) + list(params))}")
        for style in styles:
            for path in hit_params:
                if style.input or style.output:
                    raise DistGraphError(f"parallelize: {style} lays out a layer's input and "
                                         f"output; pattern {pattern!r} names the parameter "
                                         f"{path!r}: name its layer")
                _split(params[path], path, style, pattern, mesh, owners)
            for path in hit_layers:
                layer = layers[path]
                if style.splits:
                    weight = layer._parameters.get("weight")
                    if weight is None:
                        raise DistGraphError(f"parallelize: {style} (pattern {pattern!r}) "
                                             f"splits a layer's weight, but {path!r} "
                                             f"({type(layer).__name__}) has none; name a "
                                             f"Linear or Embedding inside it"
                                             f"{suggest(path + '.', layers)}")
                    for leaf in ("weight", "bias"):
                        if layer._parameters.get(leaf) is not None:
                            _split(layer._parameters[leaf], f"{path}.{leaf}", style, pattern,
                                   mesh, owners)
                if style.input or style.output:
                    wraps.setdefault(path, (layer, []))[1].append((style, pattern))
    for path, (_, styles) in wraps.items():
        for side in ("input", "output"):
            asked = [(s, pat) for s, pat in styles if getattr(s, side)]
            if len({getattr(s, side) for s, _ in asked}) > 1:
                raise DistGraphError(f"parallelize: layer {path!r} gets two layouts of its "
                                     f"{side}: {asked[0][0]} (pattern {asked[0][1]!r}) and "
                                     f"{asked[-1][0]} (pattern {asked[-1][1]!r}); give one")
    return wraps


def matches(pattern: str, path: str) -> bool:
    """Whether dotted ``path`` matches ``pattern`` component by component, each an
    ``fnmatch`` pattern (``*`` stays within one component, as a shell glob within a
    folder): ``"blocks.*.mlp.fc1"`` matches ``"blocks.3.mlp.fc1"``, not its
    ``"blocks.3.mlp.fc1.weight"``."""
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(fnmatch.fnmatchcase(h, w)
                                          for w, h in zip(want, have))


def _styles(pattern, given) -> list:
    styles = list(given) if isinstance(given, (list, tuple)) else [given]
    for s in styles:
        if isinstance(s, type) and issubclass(s, ParallelStyle):
            raise DistGraphError(f"parallelize: pattern {pattern!r} gives the class "
                                 f"{s.__name__}; give an instance: dg.{s.__name__}()")
        if not isinstance(s, ParallelStyle):
            raise DistGraphError(f"parallelize: pattern {pattern!r} gives {s!r}; give a style "
                                 f"(dg.ColWiseParallel(), dg.RowWiseParallel(), "
                                 f"dg.SequenceParallelBegin() ...) or a list of them")
    splits = [s for s in styles if isinstance(s, (ColWiseParallel, RowWiseParallel))]
    if len(splits) > 1:
        raise DistGraphError(f"parallelize: pattern {pattern!r} gives {splits[0]} and "
                             f"{splits[1]}; a layer is split one way")
    return styles


def _split(param, path, style, pattern, mesh, owners) -> None:
    spec = style.param_spec(param.shape, "mp")
    if spec is None:
        return
    before = owners.get(path)
    if before is not None and before[2] != spec:
        raise DistGraphError(f"parallelize: parameter {path!r} is split by {before[1]} (pattern "
                             f"{before[0]!r}) and by {style} (pattern {pattern!r}); give one")
    owners[path] = (pattern, style, spec)
    shard_tensor(param, mesh, spec)


def _split_experts(model, specs, mesh) -> None:
    """The stacked experts' dim 0 over ``ep`` (each process holds E / ep experts)."""
    experts = [(path, layer) for path, layer in model.named_sublayers()
               if getattr(layer, "experts_stacked", False)]
    if not experts and mesh.dim_size("ep") > 1:
        raise DistGraphError(f"parallelize: mesh dim 'ep' splits a mixture of experts' experts, "
                             f"but {type(model).__name__} has none (dg.nn.Mixtral has); for a "
                             f"dense model leave the dim out or name it 'dp'")
    for path, layer in experts:
        for name, p in layer.named_parameters(path):
            spec = specs[name]
            if spec.dims[0] is not None:
                raise DistGraphError(f"parallelize: the expert dim 0 of {name!r} goes over mesh "
                                     f"dim 'ep', but the mp plan splits it ({spec}); split its "
                                     f"other dims")
            specs[name] = ShardSpec(("ep",) + spec.dims[1:])


def _split_over_dp(model, specs, mesh) -> None:
    """Level 3: each parameter's first dim that is not split and ``dp`` divides, over
    ``dp``."""
    n = mesh.dim_size("dp")
    for name, p in model.named_parameters():
        dims = list(specs[name].dims)
        for d, size in enumerate(p.shape):
            if dims[d] is None and size % n == 0:
                dims[d] = "dp"
                specs[name] = ShardSpec(dims)
                break


# -- activations -----------------------------------------------------------------------------

def _entries(mesh, ndim, seq=None, last=None) -> list:
    """A [batch, seq, ..., last] activation's spec on ``mesh``: the batch over the
    data-parallel dims, dim 1 over ``seq`` (else ``cp`` where the mesh has it), the last
    dim over ``last``."""
    batch = tuple(d for d in BATCH_DIMS if d in mesh.dim_names)
    dims = [None] * ndim
    if ndim:
        dims[0] = batch[0] if len(batch) == 1 else (batch or None)
    if ndim >= 2:
        dims[1] = seq or ("cp" if "cp" in mesh.dim_names else None)
    if last is not None and ndim >= 2:
        dims[-1] = last
    return dims


def _activation_spec(kind, value, mesh, path, style, side) -> list:
    ndim = len(value.shape)
    if kind == SEQUENCE:
        if ndim < 3:
            raise DistGraphError(f"parallelize: {style} on {path!r} splits its {side}'s sequence "
                                 f"(dim 1 of [batch, seq, hidden]), but the {side} "
                                 f"{value.name!r} has shape {list(value.shape)}")
        if "cp" in mesh.dim_names:
            raise DistGraphError(f"parallelize: {style} on {path!r} splits the sequence over "
                                 f"'mp', but the mesh splits it over 'cp' already; use one")
        return _entries(mesh, ndim, seq="mp")
    if kind == FEATURES:
        return _entries(mesh, ndim, last="mp")
    return _entries(mesh, ndim)


def _wrap(layer, mesh, styles, path, gathered) -> None:
    """``layer`` runs its forward consuming its first input and producing its first output
    as ``styles`` ask, and reading its parameters named in ``gathered`` in the spec given
    there (level 3: gathered over dp before use); its own forward kept under WRAPPED."""
    own = layer.forward
    inputs = [s for s, _ in styles if s.input]
    outputs = [s for s, _ in styles if s.output]

    @functools.wraps(own)
    def forward(*args, **kwargs):
        builder = active_builder()
        x = args[0] if args else None
        if builder is None or not isinstance(x, Value):
            return own(*args, **kwargs)
        wanted = {}
        if inputs:
            style = inputs[0]
            spec = to_shard_spec(_activation_spec(style.input, x, mesh, path, style, "input"),
                                 mesh, len(x.shape), f"the input of {path!r}")
            spec.validate(mesh, x.shape, f"input {x.name!r} of {path!r} ({style})")
            wanted[x.name] = spec
        for leaf, spec in gathered.items():
            wanted[builder.as_value(layer._parameters[leaf]).name] = spec
        if not wanted:
            out = own(*args, **kwargs)
        else:
            outer = builder.op_annotation
            if outer is not None and outer.mesh == mesh:
                wanted = {**dict(outer.in_specs), **wanted}
            with builder.scope(op_annotation=OpAnnotation(mesh, tuple(wanted.items()))):
                out = own(*args, **kwargs)
        if not outputs:
            return out
        several = isinstance(out, (tuple, list))
        first = out[0] if several else out
        style = outputs[0]
        spec = _activation_spec(style.output, first, mesh, path, style, "output")
        if not style.output_moved:          # the layer makes it so: pinned where it is made
            shard_tensor(first, mesh, spec)
            return out
        # Paddle reshards the output after the layer (a post-hook): the layer makes it as
        # its rule does and a copy takes it in the layout asked, so the move is a reshard
        # between them (a pending sum reduce-scattered), not the layer's ops laid out anew
        # to make that layout themselves (a weight gathered)
        with builder.scope(op_annotation=OpAnnotation(mesh, ())):
            moved = ops.scale(first, 1.0)
        shard_tensor(moved, mesh, spec)
        return (moved, *out[1:]) if several else moved

    _replace_forward(layer, forward)


def _wrap_inputs(model, mesh) -> None:
    """The model's forward splits its inputs' batch over the data-parallel dims of
    ``mesh`` (and their dim 1 over ``cp``), unless the feeds come annotated."""
    if not any(d in mesh.dim_names for d in BATCH_DIMS + ("cp",)):
        return
    own = model.forward

    @functools.wraps(own)
    def forward(*args, **kwargs):
        builder = active_builder()
        fed = builder is not None and any(v.annotation is not None
                                          for v in builder.program.inputs)
        if builder is not None and not fed:
            for x in args:
                if isinstance(x, Value) and x.shape and x.annotation is None:
                    shard_tensor(x, mesh, _entries(mesh, len(x.shape)))
        return own(*args, **kwargs)

    _replace_forward(model, forward)


def _replace_forward(layer, forward) -> None:
    """``layer`` runs ``forward``; its own (an instance's, e.g. a shard_op clone's, or
    None: its class's) kept under WRAPPED."""
    layer.__dict__.setdefault(WRAPPED, layer.__dict__.get("forward"))
    object.__setattr__(layer, "forward", forward)


def _unwrap(model) -> None:
    """Undo an earlier parallelize's wrappers (a second call lays the model out anew)."""
    for layer in [model] + [sub for _, sub in model.named_sublayers()]:
        if WRAPPED in layer.__dict__:
            own = layer.__dict__.pop(WRAPPED)
            if own is None:
                del layer.__dict__["forward"]
            else:
                object.__setattr__(layer, "forward", own)
