"""Build whole programs from a model: forward (+ loss) for evaluation and prediction,
forward + loss + backward + update for training; with ``amp`` in mixed precision
(:mod:`distgraph.optim.amp`).

Example::

    built = build_program(model, [InputSpec([4, 16], name="x")], [InputSpec([4, 1], name="y")],
                          loss=nn.MSELoss(), optimizer=optim.SGD(0.1), mode="train")
    built.program.pretty()
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

from distgraph import dtypes
from distgraph.autodiff import append_backward
from distgraph.errors import DistGraphError
from distgraph.ir import Program, Role
from distgraph.optim.amp import LossScaling, low_precision
from distgraph.trace import Builder, flatten_outputs, make_inputs

MODES = ("train", "eval", "predict")


@dataclass
class BuiltProgram:
    program: Program
    mode: str
    feed_names: list
    output_names: list
    loss_name: str | None = None
    grad_names: dict = field(default_factory=dict)
    label_names: list = field(default_factory=list)
    block_paths: tuple = ()       # paths of the model's blocks (recompute units)
    amp: str | None = None        # the mixed-precision dtype it computes in
    sharding_level: int = 0       # its optimizer's ZeRO level (dg.parallelize's dp_config)

    @property
    def fetch_names(self) -> list:
        """What a step brings to every process: the loss when training, the loss and the
        outputs when evaluating (metrics read them), the outputs when predicting."""
        if self.mode == "train" or self.loss_name is None:
            return [self.loss_name] if self.loss_name else list(self.output_names)
        if self.mode == "eval":
            return [self.loss_name] + [n for n in self.output_names if n != self.loss_name]
        return list(self.output_names)


def build_program(model, input_specs, label_specs=(), loss=None, optimizer=None,
                  mode="train", amp=None, loss_scale=2.0 ** 16,
                  loss_scale_window=2000, context_parallel=None,
                  micro_batches: int | None = 1) -> BuiltProgram:
    """The program of ``model`` for ``mode``; ``amp`` ("bfloat16", "float16"): mixed
    precision, float16 with a dynamic loss scale from ``loss_scale`` (doubled after
    ``loss_scale_window`` good steps); ``context_parallel`` ("ring", "ulysses"): the
    form its attention ops run in where their sequence is split (None: each op's
    cheaper); ``micro_batches``: the count the step will run (the Strategy's), for a
    model whose auxiliary loss is computed per micro-batch (Mixtral's load balancing)."""
    if mode not in MODES:
        raise DistGraphError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "train" and (loss is None or optimizer is None):
        raise DistGraphError("training needs both a loss and an optimizer")
    model.assign_paths()
    (model.train if mode == "train" else model.eval)()
    builder = Builder(Program(), {id(p): n for n, p in model.named_parameters()}, amp)
    builder.context_parallel = context_parallel
    inputs = make_inputs(builder, input_specs)
    labels = make_inputs(builder, label_specs) if mode != "predict" else []
    loss_value = scaling = None
    with builder.active():
        fed = [_cast(builder, v, amp) if low_precision(amp, v.dtype) else v for v in inputs]
        outputs = [builder.as_value(o) for o in flatten_outputs(model(*fed))]
        if amp is not None:       # the loss and what is fetched in float32
            outputs = [_cast(builder, o, "float32") if o.dtype == amp else o for o in outputs]
        if loss is not None and mode != "predict":
            with builder.scope(role=Role.LOSS):
                loss_value = builder.as_value(loss(*outputs, *labels))
                extra = _auxiliary_loss(model, micro_batches)
                if extra is not None:
                    if extra.dtype != loss_value.dtype:    # a 16-bit term under amp
                        extra = _cast(builder, extra, loss_value.dtype)
                    loss_value = builder.emit("add", [loss_value, extra])[0]
                if amp == "float16" and mode == "train":
                    scaling = LossScaling(loss_scale, loss_scale_window)
                    scaled = scaling.scale_loss(builder, loss_value)
    program = builder.program
    if mode == "predict":
        program.inputs = inputs
    program.outputs = outputs + ([loss_value] if loss_value is not None else [])
    grads = {}
    if mode == "train":
        trainable = {n for n, p in model.named_parameters() if p.trainable}
        params = [v for v in program.parameters if v.name in trainable]
        grads = append_backward(program, scaled if scaling else loss_value, params)
        if amp is not None:
            widened_gradients(program)
        optimizer.append_update(program, grads, scaling)
    blocks = tuple(p for p, layer in model.named_sublayers()
                   if getattr(layer, "recompute_unit", False))
    return BuiltProgram(program, mode, [v.name for v in program.inputs],
                        [v.name for v in outputs],
                        loss_value.name if loss_value is not None else None,
                        {n: g.name for n, g in grads.items()}, [v.name for v in labels],
                        blocks, amp,
                        getattr(optimizer, "sharding_level", 0) if mode == "train" else 0)


def _auxiliary_loss(model, micro_batches):
    """The term a model adds to its training loss (Mixtral's router load-balancing
    loss): ``model.auxiliary_loss(micro_batches)`` after its forward (one that takes no
    argument: ``auxiliary_loss()``, a loss of the whole batch, with one micro-batch
    only), None if it has none."""
    aux = getattr(model, "auxiliary_loss", None)
    if not callable(aux):
        return None
    if "micro_batches" in inspect.signature(aux).parameters:
        return aux(micro_batches=micro_batches)
    if micro_batches != 1:
        raise DistGraphError(f"{type(model).__name__}.auxiliary_loss() takes no micro_batches: "
                             f"it is a loss of the whole batch, which micro-batches cannot "
                             f"compute; accept micro_batches (a loss per micro-batch) or use "
                             f"Strategy(micro_batches=1)")
    return aux()


def widened_gradients(program) -> None:
    """Under amp a weight's gradient comes out of its gradient GEMM in the 16-bit dtype
    and is cast to its float32 master's: the GEMM writes it in float32 instead
    (``matmul(out_dtype="float32")``: the product it accumulated in float32, unrounded),
    one pass over every weight's gradient fewer per micro-batch, as Megatron-LM's
    gradient accumulation fusion writes its float32 gradient buffers. Only where the
    cast is the product's one reader; the cast's result keeps its name (the gradient's)."""
    producers, readers = program.producers(), program.consumers()
    fetched = {v.name for v in program.outputs}
    kept = []
    for op in program.ops:
        made = producers.get(op.inputs[0].name) if op.type == "cast" else None
        if made is not None and op.role is Role.BACKWARD and made.type == "matmul" and \
                made.role is Role.BACKWARD and op.outputs[0].dtype == "float32" and \
                op.inputs[0].dtype in dtypes.HALF_DTYPES and \
                len(readers[op.inputs[0].name]) == 1 and op.inputs[0].name not in fetched:
            del program.values[made.outputs[0].name]
            made.outputs[0] = op.outputs[0]
            made.attrs["out_dtype"] = "float32"
            continue
        kept.append(op)
    program.ops = kept


def _cast(builder, v, dtype):
    return builder.emit("cast", [v], {"dtype": dtype})[0]
