"""Mixed precision: the forward and backward in 16 bit, float32 master weights.

``Strategy(amp="bfloat16" | "float16")`` builds the training program so that

- parameters stay float32 (the master weights: what ``state_dict()``, checkpoints and the
  optimizer read and write); each is cast to the 16-bit dtype once, where the forward
  first reads it, and its gradient is cast back and accumulated in float32;
- float inputs are cast to 16 bit; the model's outputs are cast back to float32 before
  the loss (as torch's autocast computes cross-entropy in float32), so the loss and the
  fetched outputs are float32;
- the optimizer's moments are float32 (they are the parameters' dtype);
- under float16 (5 exponent bits) the loss is scaled before the backward
  (:class:`LossScaling`): the gradients are unscaled in the update, a step whose
  gradients hold an inf or NaN is not applied and halves the scale, and
  ``loss_scale_window`` good steps in a row double it (torch's GradScaler rules). The
  scale is kept as the exponent of a power of two over ``Strategy.loss_scale``
  (``amp@SCALE_EXP``, with the good steps in ``amp@GOOD``): optimizer states that start
  at zero, saved and restored with the others.

The runtime computes a kernel whose operands are 16-bit in float32 and rounds its
results to their 16-bit dtype (numpy has no 16-bit BLAS); on GPUs CuPy's half type.
The cost model sees the 16-bit activations (half their bytes) and the float32 masters,
gradients and moments as they are.

Example::

    engine = dg.Engine(model, loss, dg.optim.AdamW(1e-4), strategy=dg.Strategy(amp="bfloat16"))
"""

from __future__ import annotations

from distgraph import dtypes
from distgraph.ir import Role, Value

SCALE_EXP, GOOD = "amp@SCALE_EXP", "amp@GOOD"


def low_precision(amp: str | None, dtype: str) -> bool:
    """Whether a value of ``dtype`` is computed in ``amp``'s 16-bit dtype: a float
    wider than it."""
    return amp is not None and dtypes.is_float(dtype) and dtypes.itemsize(dtype) > 2


class LossScaling:
    """float16's dynamic loss scale (module docstring): ``initial`` scale, doubled after
    ``window`` good steps."""

    def __init__(self, initial: float, window: int):
        self.initial, self.window = float(initial), int(window)

    def _state(self, builder, name: str) -> Value:
        value = builder.program.values.get(name)
        if value is None:
            value = builder.program.add_value(Value(name, (), "float32", persistable=True,
                                                    role=Role.OPTIMIZE))
        return value

    def scale_loss(self, builder, loss: Value) -> Value:
        """``loss`` times the current scale (the backward starts from it)."""
        (scale,) = builder.emit("loss_scale_of", [self._state(builder, SCALE_EXP)],
                                {"initial": self.initial})
        return builder.emit("multiply", [loss, scale])[0]

    def unscale(self, builder, grads: dict) -> tuple:
        """({name: gradient / scale}, apply): the gradients of the loss, and whether the
        step is applied (no gradient entry is inf or NaN)."""
        exponent, good = self._state(builder, SCALE_EXP), self._state(builder, GOOD)
        (scale,) = builder.emit("loss_scale_of", [exponent], {"initial": self.initial})
        counts = [builder.emit("nonfinite_count", [g])[0] for g in grads.values()]
        total = counts[0]
        for c in counts[1:]:
            total = builder.emit("add", [total, c])[0]
        new_exponent, new_good, apply = builder.emit(
            "loss_scale_update", [exponent, good, total], {"window": self.window},
            names=[f"{SCALE_EXP}@OUT", f"{GOOD}@OUT", "amp@APPLY"])
        new_exponent.alias_of, new_good.alias_of = SCALE_EXP, GOOD
        unscaled = {}
        for name, g in grads.items():
            factor = scale if g.dtype == "float32" else builder.emit(
                "cast", [scale], {"dtype": g.dtype})[0]
            unscaled[name] = builder.emit("divide", [g, factor])[0]
        return unscaled, apply
