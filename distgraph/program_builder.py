"""Build whole programs from a model: forward (+ loss) for evaluation and prediction,
forward + loss + backward + update for training.

Example::

    built = build_program(model, [InputSpec([4, 16], name="x")], [InputSpec([4, 1], name="y")],
                          loss=nn.MSELoss(), optimizer=optim.SGD(0.1), mode="train")
    built.program.pretty()
"""

from __future__ import annotations

from dataclasses import dataclass, field

from distgraph.autodiff import append_backward
from distgraph.errors import DistGraphError
from distgraph.ir import Program, Role
from distgraph.nn.layers import TransformerBlock
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
    block_paths: tuple = ()       # paths of the model's TransformerBlocks (recompute units)

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
                  mode="train") -> BuiltProgram:
    if mode not in MODES:
        raise DistGraphError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "train" and (loss is None or optimizer is None):
        raise DistGraphError("training needs both a loss and an optimizer")
    model.assign_paths()
    (model.train if mode == "train" else model.eval)()
    builder = Builder(Program(), {id(p): n for n, p in model.named_parameters()})
    inputs = make_inputs(builder, input_specs)
    labels = make_inputs(builder, label_specs) if mode != "predict" else []
    loss_value = None
    with builder.active():
        outputs = [builder.as_value(o) for o in flatten_outputs(model(*inputs))]
        if loss is not None and mode != "predict":
            with builder.scope(role=Role.LOSS):
                loss_value = builder.as_value(loss(*outputs, *labels))
    program = builder.program
    if mode == "predict":
        program.inputs = inputs
    program.outputs = outputs + ([loss_value] if loss_value is not None else [])
    grads = {}
    if mode == "train":
        trainable = {n for n, p in model.named_parameters() if p.trainable}
        params = [v for v in program.parameters if v.name in trainable]
        grads = append_backward(program, loss_value, params)
        optimizer.append_update(program, grads)
    blocks = tuple(p for p, layer in model.named_sublayers() if isinstance(layer, TransformerBlock))
    return BuiltProgram(program, mode, [v.name for v in program.inputs],
                        [v.name for v in outputs],
                        loss_value.name if loss_value is not None else None,
                        {n: g.name for n, g in grads.items()}, [v.name for v in labels],
                        blocks)
