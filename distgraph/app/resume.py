"""What a checkpoint records besides tensors, and what loading it restores.

``training``: the global ``step`` (optimizer steps taken; dropout masks and the
learning-rate schedule are functions of it), the position of the last fit as
(``epoch``, ``batch``: batches done in that epoch) and how that fit read its data
(``batch_size``, ``shuffle``, ``drop_last``, ``steps_per_epoch``, ``dataset_size``, and
``input_keys`` for dict samples), so a resumed fit can continue the same epoch with the
same batches.
``optimizer``: its type and hyper-parameters, ``learning_rate`` (a number or the
schedule's ``to_dict()``) and ``lr``, the rate of the next step.
``rng``: ``data_seed`` (shuffling is a function of (seed, epoch)), ``dropout_seeds``
(per Dropout layer path), ``param_generator`` (the state of ``dg.seed``'s generator).

Example::

    info = checkpoint_info(engine)        # saved into metadata.json
    restore_info(engine, info)            # after check_checkpoint(engine, reader)
"""

from __future__ import annotations

from distgraph import dtypes
from distgraph.app.checkpoint import check_tensors
from distgraph.nn.layers import Dropout
from distgraph.optim import STEP
from distgraph.optim.lr import LRSchedule


def _dropouts(model) -> dict:
    return {path: layer for path, layer in model.named_sublayers() if isinstance(layer, Dropout)}


def checkpoint_info(engine) -> dict:
    opt = engine.optimizer
    optimizer = None
    if opt is not None:
        rate = opt.learning_rate
        optimizer = {**opt.hyperparameters(),
                     "learning_rate": rate.to_dict() if isinstance(rate, LRSchedule) else rate,
                     "lr": opt.lr_at(engine.global_step)}
    loops = engine._loops
    epoch, batch = loops.position
    return {
        "training": {"step": engine.global_step, "epoch": epoch, "batch": batch,
                     **(loops.fit_config or {})},
        "optimizer": optimizer,
        "rng": {"data_seed": loops.data_seed,
                "dropout_seeds": {p: layer.seed for p, layer in _dropouts(engine.model).items()},
                "param_generator": dtypes.param_rng().bit_generator.state},
    }


def check_checkpoint(engine, reader) -> None:
    """Raise CheckpointError unless the checkpoint holds every parameter of the model,
    with its shape and dtype, and only optimizer states this Engine's optimizer keeps."""
    params = engine.model.named_parameters()
    expected = {n: (p.shape, p.dtype) for n, p in params}
    states = {}
    opt = engine.optimizer
    if opt is None:        # an evaluation Engine keeps whatever states the file has
        states = {n: (reader.shape(n), reader.dtype(n)) for n in reader.names
                  if reader.kind(n) == "optimizer"}
    else:
        trainable = {n: p for n, p in params if p.trainable}
        for name in opt.state_names(trainable):
            owner = name.rsplit("@", 1)[0]
            states[name] = ((), "int64") if name == STEP else \
                (trainable[owner].shape, trainable[owner].dtype)
    saved = (reader.info.get("optimizer") or {}).get("type")
    hint = ""
    if opt is not None and reader.has_optimizer_state and saved != type(opt).__name__:
        hint = (f"The checkpoint was saved with the {saved} optimizer, this Engine has "
                f"{type(opt).__name__}: give the Engine the checkpoint's optimizer")
    # Which states a training program keeps depends on which parameters get gradients;
    # a missing one is named when the training program is bound (HeldState.bind).
    check_tensors(reader, {**expected, **states}, allowed_missing=states, hint=hint)


def restore_info(engine, info: dict) -> None:
    loops = engine._loops
    training = info.get("training", {})
    loops.step = int(training.get("step", 0))
    loops.position = (int(training.get("epoch", 0)), int(training.get("batch", 0)))
    loops.loaded = True
    loops.fit_config = {k: v for k, v in training.items()
                        if k not in ("step", "epoch", "batch")}
    rng = info.get("rng", {})
    loops.data_seed = rng.get("data_seed", loops.data_seed)
    layers = _dropouts(engine.model)
    for path, seed in rng.get("dropout_seeds", {}).items():
        if path in layers:
            layers[path].seed = int(seed)      # part of the program key: plans follow
    state = rng.get("param_generator")
    generator = dtypes.param_rng().bit_generator
    if state and state.get("bit_generator") == type(generator).__name__:
        generator.state = state
