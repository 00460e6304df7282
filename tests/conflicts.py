"""Programs whose operands disagree, for the tests and the bench of completion's conflict
resolution (bench/completion_bytes.py): the examples of issue #8 as small traced
programs, completed, and GPT-tiny with random conflicting annotations.

Example::

    program = CONFLICTS["cross_entropy"]()     # completed
"""

from __future__ import annotations

import itertools
import random

import plans as P
from distgraph.passes.completion.complete import complete

import distgraph as dg
from distgraph.program_builder import build_program


def random_gpt_program(seed: int):
    """GPT-tiny with four random parameters and the input annotated at random on a 2x2
    mesh (the conflicts of tests/test_completion.py's randomly_annotated_gpt)."""
    mesh = dg.ProcessMesh([[0, 1], [2, 3]], dim_names=["dp", "mp"])
    r = random.Random(seed)
    dg.seed(0)
    gpt = dg.nn.GPT(**P.GPT_DIMS)
    for _, p in r.sample(list(gpt.named_parameters()), 4):
        choices = [[None] * len(p.shape)]
        for d, m in itertools.product(range(len(p.shape)), ("dp", "mp")):
            choices.append([m if i == d else None for i in range(len(p.shape))])
        dg.shard_tensor(p, mesh, r.choice(choices))
    x_spec = r.choice([["dp", None], [None, None], [None, "mp"], ["mp", "dp"]])

    class Inp(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.inner = gpt

        def forward(self, x):
            return self.inner(dg.shard_tensor(x, mesh, x_spec))

    built = build_program(Inp(), [dg.InputSpec([P.BATCH, 8], "int64", "x")],
                          [dg.InputSpec([P.BATCH, 8], "int64", "y")], dg.nn.CrossEntropyLoss(),
                          dg.optim.AdamW(1e-3))
    return complete(built.program)


# ---- the conflict examples of issue #8 -------------------------------------------------
X4 = dg.ProcessMesh([0, 1, 2, 3], ["x"])
XY = dg.ProcessMesh([[0, 1, 2], [3, 4, 5]], ["x", "y"])


def _traced(fn, *specs, cluster=None):
    return complete(dg.trace(fn, *specs), cluster=cluster)


def conflict_add():
    """add: x [None, None, x] + y [x, None, None] (same shape)."""
    def f(a, b):
        return dg.ops.relu(dg.shard_tensor(a, X4, [None, None, "x"])
                           + dg.shard_tensor(b, X4, ["x", None, None]))
    return _traced(f, dg.InputSpec([8, 8, 8], name="a"), dg.InputSpec([8, 8, 8], name="b"))


def conflict_cross_entropy(cluster=None):
    """softmax cross-entropy: logits from a vocabulary-parallel head (class dim split
    over x, batch dims not yet known), labels split on the batch over x; completed on
    ``cluster`` (default: this machine's, ``Cluster.local(4)``)."""
    def f(h, w, labels):
        dg.shard_tensor(w, X4, [None, "x"])
        dg.shard_tensor(labels, X4, ["x", None])
        return dg.ops.cross_entropy(dg.ops.matmul(h, w), labels)
    return _traced(f, dg.InputSpec([8, 16, 32], name="h"), dg.InputSpec([32, 256], name="w"),
                   dg.InputSpec([8, 16], "int64", name="labels"), cluster=cluster)


def conflict_bias():
    """an annotated bias [x] added to an activation that wants x for its batch dim: the
    layer runs under shard_op with its input consumed [x, None], its weight [None, x]."""
    dg.seed(0)
    lin = dg.nn.Linear(16, 64)
    dg.shard_tensor(lin.weight, X4, [None, "x"])
    dg.shard_tensor(lin.bias, X4, ["x"])
    layer = dg.shard_op(lin, X4, in_shard_specs=[["x", None]])
    return _traced(lambda a: dg.ops.relu(layer(a)), dg.InputSpec([8, 16], name="a"))


def conflict_embedding():
    """embedding: ids [x, None], table [None, (x, y)] on a 2x3 mesh."""
    dg.seed(0)
    emb = dg.nn.Embedding(60, 24)
    dg.shard_tensor(emb.weight, XY, [None, ("x", "y")])

    def f(ids):
        return dg.ops.relu(emb(dg.shard_tensor(ids, XY, ["x", None])))
    return _traced(f, dg.InputSpec([8, 16], "int64", name="ids"))


def conflict_matmul():
    """matmul: x [None, x] transposed, y [None, (x, y)] on a 2x3 mesh."""
    def f(a, b):
        dg.shard_tensor(a, XY, [None, "x"])
        dg.shard_tensor(b, XY, [None, ("x", "y")])
        return dg.ops.relu(dg.ops.matmul(a, b, transpose_x=True))
    return _traced(f, dg.InputSpec([32, 16], name="a"), dg.InputSpec([32, 48], name="b"))


def conflict_reshape():
    """reshape: [12, 24, 36] with dim 1 split over x, to (288, 36)."""
    def f(a):
        h = dg.ops.relu(dg.shard_tensor(a, X4, [None, "x", None]))
        return dg.ops.relu(dg.ops.reshape(h, [288, 36]))
    return _traced(f, dg.InputSpec([12, 24, 36], name="a"))


CONFLICTS = {"add": conflict_add, "cross_entropy": conflict_cross_entropy,
             "bias": conflict_bias, "embedding": conflict_embedding,
             "matmul_t": conflict_matmul, "reshape": conflict_reshape}
