"""Python operators on traced tensors: ``+ - * / @``, unary minus and ``.T`` are the ops
of this package (``x + y`` is ``add(x, y)``).

The IR's :class:`~distgraph.ir.Value` is plain data and imports nothing above it; this
package gives Values, and Parameters (which become Values when a traced op uses them),
their operators when it is imported, which every ``import distgraph`` does.

Example::

    y = x @ w + b          # inside a traced function: matmul, then add
"""

from __future__ import annotations

from distgraph.ops.elementwise import add, divide, multiply, neg, subtract
from distgraph.ops.linalg import matmul
from distgraph.ops.shape import transpose


def _transposed(x):
    perm = list(range(len(x.shape)))
    perm[-2:] = perm[-2:][::-1]
    return transpose(x, perm)


OPERATORS = {
    "__add__": lambda a, b: add(a, b), "__radd__": lambda a, b: add(b, a),
    "__sub__": lambda a, b: subtract(a, b), "__rsub__": lambda a, b: subtract(b, a),
    "__mul__": lambda a, b: multiply(a, b), "__rmul__": lambda a, b: multiply(b, a),
    "__truediv__": lambda a, b: divide(a, b), "__rtruediv__": lambda a, b: divide(b, a),
    "__matmul__": lambda a, b: matmul(a, b), "__rmatmul__": lambda a, b: matmul(b, a),
    "__neg__": neg,
    "T": property(_transposed),
}


def install(cls) -> None:
    """Give ``cls`` (Value, Parameter) the operators of traced tensors."""
    for name, fn in OPERATORS.items():
        setattr(cls, name, fn)
