"""Layer: the base of models. Parameters and sub-layers are registered by assigning them
as attributes; their paths (``blocks.0.attn.qkv.weight``) name the traced Values.

Example::

    class MLP(Layer):
        def __init__(self):
            super().__init__()
            self.fc1 = Linear(16, 64)
            self.fc2 = Linear(64, 16)
        def forward(self, x):
            return self.fc2(dg.ops.relu(self.fc1(x)))
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from distgraph.errors import DistGraphError
from distgraph.parameter import Parameter
from distgraph.trace import active_builder


class Layer:
    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_sublayers", OrderedDict())
        object.__setattr__(self, "_path", "")     # set by assign_paths when traced
        # (layer, attribute name) it was first assigned to: its path before it is traced
        object.__setattr__(self, "_parent", None)
        object.__setattr__(self, "training", True)

    def extra_repr(self) -> str:
        """What ``repr`` shows between the parentheses: ``Linear(16, 64)``."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"

    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise DistGraphError(f"{type(self).__name__}.__init__ must call super().__init__() "
                                 "before assigning attributes")
        self._parameters.pop(name, None)
        self._sublayers.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
            if value.owner is None:
                value.owner, value.attr_name = self, name
        elif isinstance(value, Layer):
            self._sublayers[name] = value
            if getattr(value, "_parent", None) is None and value is not self:
                object.__setattr__(value, "_parent", (self, name))
        object.__setattr__(self, name, value)

    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} defines no forward()")

    def __call__(self, *args, **kwargs):
        builder = active_builder()
        if builder is None:
            return self.forward(*args, **kwargs)
        with builder.scope(layer=self._path):
            return self.forward(*args, **kwargs)

    # -- traversal ------------------------------------------------------------------------
    def named_sublayers(self, prefix=""):
        for name, layer in self._sublayers.items():
            path = f"{prefix}.{name}" if prefix else name
            yield path, layer
            yield from layer.named_sublayers(path)

    def named_parameters(self, prefix=""):
        """[(path, Parameter)] in registration order, each parameter once."""
        seen = set()
        result = []
        for path, p in self._named_parameters(prefix):
            if id(p) not in seen:
                seen.add(id(p))
                result.append((path, p))
        return result

    def _named_parameters(self, prefix):
        for name, p in self._parameters.items():
            yield (f"{prefix}.{name}" if prefix else name), p
        for name, layer in self._sublayers.items():
            yield from layer._named_parameters(f"{prefix}.{name}" if prefix else name)

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def _model_path(self) -> str:
        """The layer's path in its model (``blocks.0.mlp.fc1``; ``""`` for the model):
        the one tracing assigned, else the attributes it was first assigned as, up to the
        layer that holds it and is held by none. Errors name parameters by it."""
        if self._path:
            return self._path
        names, layer, seen = [], self, {id(self)}
        while getattr(layer, "_parent", None) is not None and id(layer._parent[0]) not in seen:
            layer, name = layer._parent
            names.append(name)
            seen.add(id(layer))
        return ".".join(reversed(names))

    def assign_paths(self) -> None:
        """Record each sub-layer's path (used as the layer name in errors and the IR)."""
        object.__setattr__(self, "_path", "")
        for path, layer in self.named_sublayers():
            object.__setattr__(layer, "_path", path)

    def train(self):
        for layer in [self] + [sub for _, sub in self.named_sublayers()]:
            object.__setattr__(layer, "training", True)
        return self

    def eval(self):
        for layer in [self] + [sub for _, sub in self.named_sublayers()]:
            object.__setattr__(layer, "training", False)
        return self

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return OrderedDict((n, p.numpy()) for n, p in self.named_parameters())

    def set_state_dict(self, state: dict) -> None:
        params = dict(self.named_parameters())
        missing = sorted(set(params) - set(state))
        unknown = sorted(set(state) - set(params))
        if missing or unknown:
            raise DistGraphError(f"set_state_dict: missing {missing}, unexpected {unknown}")
        for n, p in params.items():
            p.set_value(np.asarray(state[n]))


class LayerList(Layer):
    """A list of layers named ``0``, ``1``, ... (``blocks.0.attn``)."""

    def __init__(self, layers=()):
        super().__init__()
        self._items = []
        for layer in layers:
            self.append(layer)

    def append(self, layer: Layer) -> None:
        setattr(self, str(len(self._items)), layer)
        self._items.append(layer)

    def __getitem__(self, i):
        return self._items[i]

    def __setitem__(self, i, layer: Layer) -> None:
        """Replace item ``i`` (its name stays ``str(i)``), e.g. with ``dg.shard_op(item,
        mesh)``."""
        i = range(len(self._items))[i]
        setattr(self, str(i), layer)
        self._items[i] = layer

    def __len__(self):
        return len(self._items)

    def __iter__(self):
        return iter(self._items)
