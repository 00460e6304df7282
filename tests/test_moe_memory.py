"""What ``moe_ffn`` keeps for its gradient, against the memory model.

The kernel keeps its routes, the rows its experts ran on, their pre-activations and the
expert outputs in ``KernelContext.saved`` (no Value holds them). Its ``saved`` hook
prices them at the expected load; here the kernel runs on a routing that *is* the
expected load (every expert gets the same number of every process's assignments) and
the arrays it leaves in ``saved`` are counted (each buffer once, views by their base,
the operands left out: they are Values the gradient reads anyway): serial and
expert-sharded forms, the all-to-all form on 2 and 4 ranks (SimulatedWorld), dropless
and with a capacity (kept and dropping). The estimate's saved activations of a Mixtral
plan then grow by exactly the hook's bytes per layer (the hook taken out for the
reference), and the intra-op search holds them from the op to its gradient."""

from __future__ import annotations

import dataclasses
import inspect
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
import distgraph.ops  # noqa: E402,F401  (registers the ops)
from distgraph import registry  # noqa: E402
from distgraph.registry import KernelContext, TensorType, get_op  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402


def _root(a):
    while a.base is not None:
        a = a.base
    return a


def measured(saved: dict, operands) -> int:
    """Bytes of the arrays reachable from ``saved`` that are not (views of) operands,
    each buffer once."""
    skip = {id(_root(a)) for a in operands}
    seen: set = set()
    total = 0

    def walk(o):
        nonlocal total
        if isinstance(o, np.ndarray):
            r = _root(o)
            if id(r) not in skip and id(r) not in seen:
                seen.add(id(r))
                total += r.nbytes
        elif isinstance(o, (tuple, list)):
            for x in o:
                walk(x)
        elif isinstance(o, dict):
            for x in o.values():
                walk(x)
        elif not (isinstance(o, (int, float, str, type(None), np.generic, KernelContext))
                  or inspect.ismodule(o)) and hasattr(o, "__dict__"):
            walk(vars(o))

    walk(saved)
    return total


def balanced(b, s, k, experts, rng):
    """ids [b, s, k]: token t's choices (t k + j) mod E, so every run of E / gcd
    consecutive tokens gives each expert the same count (the expected load)."""
    t = np.arange(b * s)[:, None] * k + np.arange(k)
    return (t % experts).reshape(b, s, k).astype("int64")


def operands(rng, b, s, d, inner, experts, k, dtype="float64"):
    ids = balanced(b, s, k, experts, rng)
    return (rng.standard_normal((b, s, d)).astype(dtype), ids,
            rng.uniform(0.1, 1, (b, s, k)).astype(dtype),
            rng.standard_normal((experts, d, inner)).astype(dtype),
            rng.standard_normal((experts, d, inner)).astype(dtype),
            rng.standard_normal((experts, inner, d)).astype(dtype))


def hook(attrs, ctx, args) -> float:
    ins = [TensorType(a.shape, str(a.dtype)) for a in args]
    return get_op("moe_ffn").saved(attrs, ctx, ins)


# b, s, d, inner, experts, k, capacity: dropless; a capacity above the load (nothing
# dropped); one below it (each sequence keeps E * C assignments)
CASES = [(2, 8, 4, 6, 4, 2, None), (2, 8, 4, 6, 4, 2, 5), (2, 8, 4, 6, 4, 2, 3),
         (1, 12, 5, 3, 6, 3, None)]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("case", CASES)
def test_the_serial_kernel_keeps_what_the_hook_prices(case, dtype):
    b, s, d, inner, experts, k, capacity = case
    args = operands(np.random.default_rng(0), b, s, d, inner, experts, k, dtype)
    saved = {}
    get_op("moe_ffn").kernel(KernelContext(np, saved=saved), *args, capacity=capacity)
    assert measured(saved, args) == hook({"capacity": capacity}, {}, args) > 0


@pytest.mark.parametrize("capacity", [None, 3])
def test_an_expert_shard_keeps_its_share(capacity):
    """Experts split, tokens whole (the output Partial): a process keeps the assignments
    of its experts only."""
    b, s, d, inner, experts, k = 2, 8, 4, 6, 4, 2
    x, ids, w, g, u, dn = operands(np.random.default_rng(1), b, s, d, inner, experts, k)
    attrs = dict(capacity=capacity, expert_start=2, num_experts=experts)
    args = (x, ids, w, g[2:], u[2:], dn[2:])
    saved = {}
    get_op("moe_ffn").kernel(KernelContext(np, saved=saved), *args, **attrs)
    assert measured(saved, args) == hook(attrs, {}, args) > 0


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("capacity", [None, 4, 2])
def test_the_all_to_all_form_keeps_what_the_hook_prices(ranks, capacity):
    """Tokens and experts over ``ranks`` processes: each keeps its routes, the rows it
    received and their pre-activations, the outputs it got back and the counts."""
    b, s, d, inner, experts, k = 4, 8, 4, 6, 8, 2
    args = operands(np.random.default_rng(2), b, s, d, inner, experts, k)
    rows, local = b // ranks, experts // ranks

    def rank(comm):
        r = comm.rank
        mine = (*(a[r * rows:(r + 1) * rows] for a in args[:3]),
                *(a[r * local:(r + 1) * local] for a in args[3:]))
        saved = {}
        group = tuple(range(ranks))
        attrs = dict(capacity=capacity, expert_start=r * local, num_experts=experts)
        get_op("moe_ffn").kernel(KernelContext(np, comm=comm, group=group, saved=saved),
                                 *mine, **attrs)
        return measured(saved, mine), hook(attrs, {"group": group}, mine)

    for got, priced in SimulatedWorld(ranks, timeout=60).run(rank):
        assert got == priced > 0


CONFIG = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
BATCH, SEQ = 4, 8


def _plan(layers: int, capacity_factor=None, strategy=None):
    """A Mixtral of ``layers`` layers, tokens and experts over ep 2 (all-to-all),
    planned with ``strategy`` (default: ``Strategy()``)."""
    from distgraph.nn.mixtral import Mixtral, MixtralConfig, expert_parallel
    from distgraph.program_builder import build_program

    dg.seed(0)
    model = Mixtral(MixtralConfig(num_hidden_layers=layers, capacity_factor=capacity_factor,
                                  **CONFIG))
    mesh = dg.ProcessMesh([0, 1], ["ep"])
    expert_parallel(model, mesh)
    built = build_program(model, [dg.InputSpec([BATCH, SEQ], "int64", "tokens")],
                          [dg.InputSpec([BATCH, SEQ], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))
    for name in ("tokens", "labels"):
        built.program.values[name].annotation = dg.DistAttr(mesh, dg.ShardSpec(["ep", None]))
    return dg.passes.plan(built, strategy or dg.Strategy(), dg.Cluster.local(2))


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_the_estimate_keeps_the_hooks_bytes_from_each_layer_to_its_gradient(
        monkeypatch, capacity_factor):
    """Saved activations (what one micro-batch keeps for its backward) and the peak of a
    2-layer Mixtral on ep 2 grow by the hook's bytes per layer: the all-to-all form's,
    the bytes measured above; without the hook the estimate counts Values only."""
    plan = _plan(2, capacity_factor)
    (op,) = [o for o in plan.local(0).program.ops if o.type == "moe_ffn"][:1]
    index = plan.local(0).program.ops.index(op)
    ctx = plan.local(0).op_context[index]
    assert "group" in ctx                                   # the all-to-all form
    per_layer = get_op("moe_ffn").saved(op.attrs, ctx, [TensorType(v.shape, v.dtype)
                                                        for v in op.inputs])
    with_hook = dg.passes.estimate(plan).processes[0]
    monkeypatch.setitem(registry._REGISTRY, "moe_ffn",
                        dataclasses.replace(get_op("moe_ffn"), saved=None))
    without = dg.passes.estimate(plan).processes[0]
    assert with_hook.saved_activations - without.saved_activations == int(2 * per_layer)
    assert with_hook.peak_memory > without.peak_memory


def test_the_search_holds_the_kept_bytes_from_the_op_to_its_gradient():
    """The intra-op search's memory of a moe_ffn node is its result plus the hook's
    bytes, and the node is live at every op up to its gradient."""
    from distgraph.nn.mixtral import Mixtral, MixtralConfig
    from distgraph.passes.search.layouts import intra_op
    from distgraph.passes.cost.layout_prices import LayoutPrices, local_bytes
    from distgraph.passes.search.layouts.space import SearchSpace
    from distgraph.program_builder import build_program

    dg.seed(0)
    model = Mixtral(MixtralConfig(num_hidden_layers=1, **CONFIG))
    built = build_program(model, [dg.InputSpec([BATCH, SEQ], "int64", "tokens")],
                          [dg.InputSpec([BATCH, SEQ], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))
    program = built.program
    mesh = dg.ProcessMesh([0, 1], ["x"])
    space = SearchSpace(program, mesh)
    costs = LayoutPrices(dg.Cluster.local(2), mesh, {0: 0, 1: 1})
    (node,) = [n for n in space.nodes if not n.is_source and
               program.ops[n.op].type == "moe_ffn"]
    op = program.ops[node.op]
    kept = costs.kept(op, node.strategies)
    assert kept.min() > 0 and len(set(kept)) > 1           # the strategies keep differently
    problem = intra_op._problem(space, costs, {}, None, mesh, None, (), True,
                                intra_op.Boundary())
    results = np.array([local_bytes(s.out_local_shapes[:1], [op.outputs[0].dtype])
                        for s in node.strategies], float)
    np.testing.assert_allclose(problem.memory[node.index], results + kept)
    grad = next(t for t, k in enumerate(space.ops) if program.ops[k].type == "moe_ffn_grad")
    assert node.index in problem.liveness[grad]
    assert node.index not in problem.liveness[grad + 1]


def test_under_recompute_only_the_copy_keeps(monkeypatch):
    """Every layer recomputed: moe_ffn is copied into the backward with the operands
    its gradient reads (tests/test_mixtral_train.py's ep4_recompute trains as serial);
    the original's instruction keeps nothing (what it kept could not serve the
    gradient), the copy's keeps. So the activations a micro-batch keeps for its backward
    do not grow by the hook's bytes, while the peak (the copy's, up to its gradient)
    does."""
    from distgraph.plan.instructions import OpInstr

    plan = _plan(2, strategy=dg.Strategy(recompute=True))
    program = plan.program_of(0)
    keeps = [(i.op_type, i.keeps) for block in program.blocks.values() for i in block.instrs
             if isinstance(i, OpInstr) and i.op_type == "moe_ffn"]
    assert sorted(keeps) == [("moe_ffn", False)] * 2 + [("moe_ffn", True)] * 2
    with_hook = dg.passes.estimate(plan).processes[0]
    monkeypatch.setitem(registry._REGISTRY, "moe_ffn",
                        dataclasses.replace(get_op("moe_ffn"), saved=None))
    without = dg.passes.estimate(plan).processes[0]
    assert with_hook.saved_activations == without.saved_activations
    assert with_hook.peak_memory > without.peak_memory
