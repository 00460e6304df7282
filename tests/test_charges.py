"""The price of a choice moved to another mesh (passes/search/layouts/charges.py,
``intra_op.price``) equals, bit for bit, the objective and peak the full problem of the
moved space gives it (``intra_op._problem``: every term as the ILP sees it, each edge a
matrix), per node memory and liveness alike: on random choices of MLP, GPT, Llama and
Mixtral programs moved between meshes of the heterogeneous cluster files (micro-batched
weights, the fetched loss, ZeRO over ``x``), and on every choice the stage DP prices
while planning a small GPT (blocks meeting their neighbours: settled, tied and received
Values)."""

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import PlanError  # noqa: E402
from distgraph.ir import Role  # noqa: E402
from distgraph.mesh import ProcessMesh  # noqa: E402
from distgraph.nn.mixtral import Mixtral, MixtralConfig  # noqa: E402
from distgraph.passes.search.layouts import intra_op  # noqa: E402
from distgraph.passes.search.stages import runs  # noqa: E402
from distgraph.passes.cost.layout_prices import LayoutPrices, layout_prices  # noqa: E402
from distgraph.passes.search.layouts.ilp_problem import (ShardingProblem, evaluate,  # noqa: E402
                                                 peak_memory)
from distgraph.passes.search.layouts.sharded_states import Zero  # noqa: E402
from distgraph.passes.search.layouts.space import SearchSpace  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402

import search_cases as S  # noqa: E402

CLUSTERS = Path(__file__).parent.parent / "resources" / "clusters"
WEIGHTS = {Role.FORWARD: 1, Role.LOSS: 1, Role.BACKWARD: 1, Role.OPTIMIZE: 1 / 4}
ZERO = Zero("x", True)      # each update offered with and without ZeRO's slice over x


def _full(moved, costs, weights, loss, world=None, boundary=None, zero=None):
    """(objective, peak, problem) of ``moved``'s choice by the full problem."""
    problem = intra_op._problem(moved, costs, weights or {}, loss, world, None, (), True,
                                boundary or intra_op.Boundary(), zero)
    fixed = [0] * len(moved.nodes)
    return evaluate(problem, fixed), peak_memory(problem, fixed), problem


def _same(moved, cluster, device_of, costs, **kw) -> bool:
    """Assert the direct price equals the full problem's; False where the choice is not
    allowed there (both say so)."""
    objective, peak, problem = _full(moved, costs, kw.get("weights"), kw.get("loss"),
                                     kw.get("world"), kw.get("boundary"), kw.get("zero"))
    try:
        priced = intra_op.price(moved, cluster, device_of, costs=costs, **kw)
    except PlanError:
        assert objective == np.inf
        return False
    assert priced.report.objective == objective
    assert priced.report.peak_memory == peak
    assert [float(m[0]) for m in priced.problem.memory] == [float(m[0]) for m in problem.memory]
    assert tuple(priced.problem.liveness) == tuple(problem.liveness)
    assert evaluate(priced.problem, priced.choice) == objective
    return True


def _mlp():
    return S.mlp_program(16, 64), "mlp"


def _gpt():
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=2, n_head=4, max_seq_len=8)
    return build_program(model, [dg.InputSpec([8, 8], "int64", "tokens")],
                         [dg.InputSpec([8, 8], "int64", "labels")], dg.nn.CrossEntropyLoss(),
                         dg.optim.AdamW(1e-3)), "gpt"


def _llama():
    dg.seed(0)
    model = dg.nn.Llama(vocab_size=64, hidden_size=32, intermediate_size=88,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=8)
    return build_program(model, [dg.InputSpec([8, 8], "int64", "tokens")],
                         [dg.InputSpec([8, 8], "int64", "labels")], dg.nn.CrossEntropyLoss(),
                         dg.optim.AdamW(1e-3)), "llama"


def _mixtral():
    dg.seed(0)
    config = MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2)
    return build_program(Mixtral(config), [dg.InputSpec([8, 8], "int64", "ids")],
                         [dg.InputSpec([8, 8], "int64", "labels")], dg.nn.CrossEntropyLoss(),
                         dg.optim.AdamW(1e-3)), "mixtral"


def _mesh(shape, devices, offset):
    """A mesh of ``shape`` (dims x, y) and its processes' devices: every other device of
    the cluster from ``offset`` (mixing its kinds and machines)."""
    n = int(np.prod(shape))
    mesh = ProcessMesh(np.arange(n).reshape(shape).tolist(), dim_names=["x", "y"])
    picked = (devices[offset::2] + devices[1 - offset::2])[:n]
    return mesh, dict(enumerate(picked))


def _random_choice(space, rng):
    """A strategy index per node: free nodes at random, followers as their leader."""
    choice = []
    for node in space.nodes:
        choice.append(choice[node.leader] if 0 <= node.leader < node.index
                      else int(rng.integers(len(node.strategies))))
    return choice


@pytest.mark.parametrize("file", ["hetero_2gpu_2xpu.yaml", "emulated_mixed_2x2.yaml",
                                  "paddle_2x8.json"])
@pytest.mark.parametrize("make", [_mlp, _gpt, _llama, _mixtral])
def test_moved_random_choices_price_as_the_full_problem(file, make):
    cluster = dg.Cluster.from_file(CLUSTERS / file)
    devices = [d.global_id for d in cluster.devices]
    built, _ = make()
    program = built.program
    rng = np.random.default_rng(len(program.ops))
    here, here_devices = _mesh((2, 2), devices, 0)
    space = SearchSpace(program, here, zero=ZERO)
    targets = [(2, 1), (1, 2), (1, 4), (2, 2)] if len(devices) >= 8 else [(1, 2), (2, 1),
                                                                           (2, 2)]
    priced = 0
    for trial in range(6):
        choice = _random_choice(space, rng)
        shape = targets[trial % len(targets)]
        mesh, device_of = _mesh(shape, devices, trial % 2)
        try:
            moved = space.rebind(mesh, choice)
        except PlanError:                   # a layout that does not divide there
            continue
        costs = LayoutPrices(cluster, mesh, device_of)
        for kw in ({}, {"weights": WEIGHTS, "loss": built.loss_name},
                   {"weights": WEIGHTS, "loss": built.loss_name, "zero": ZERO}):
            priced += _same(moved, cluster, device_of, costs, **kw)
    # the searched choice moved: allowed wherever it divides
    found = intra_op.search(program, here, cluster, here_devices, method="recursive",
                            loss=built.loss_name, memory=True, zero=ZERO)
    for shape in targets:
        mesh, device_of = _mesh(shape, devices, 1)
        try:
            moved = found.space.rebind(mesh, found.choice)
        except PlanError:
            continue
        costs = LayoutPrices(cluster, mesh, device_of)
        assert _same(moved, cluster, device_of, costs, loss=built.loss_name,
                     weights=WEIGHTS, zero=ZERO)
        priced += 1
    assert priced >= 4


def test_every_choice_priced_while_planning_a_gpt_prices_as_the_full_problem(monkeypatch):
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=6, n_head=4, max_seq_len=8)
    built = build_program(model, [dg.InputSpec([16, 8], "int64", "tokens")],
                          [dg.InputSpec([16, 8], "int64", "labels")],
                          dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-3))
    calls = []
    price = runs.price

    def spied(moved, cluster, device_of, **kw):
        calls.append((moved, cluster, device_of, kw))
        return price(moved, cluster, device_of, **kw)

    monkeypatch.setattr(runs, "price", spied)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=4, search="auto",
                           sharding=True)
    dg.passes.plan(built, strategy, dg.Cluster.from_file(CLUSTERS / "gpu_2x8.yaml"),
                   ranks=())
    assert len(calls) > 10
    kinds = set()
    for moved, cluster, device_of, kw in calls:
        boundary = kw["boundary"]
        kinds.update(k for k in ("received", "settle", "periodic") if getattr(boundary, k))
        kw = dict(kw)           # on the LayoutPrices the planning priced with
        costs = layout_prices(cluster, moved.mesh, device_of, session=kw.pop("session"))
        assert _same(moved, cluster, device_of, costs, **kw)
    assert kinds == {"received", "settle", "periodic"}


def test_one_each_names_a_wrong_number_as_the_full_check_does():
    with pytest.raises(PlanError, match=r"compute\[1\]\[0\] = nan"):
        ShardingProblem.one_each([1.0, float("nan")], [0.0, 0.0], [1, 1])
    with pytest.raises(PlanError, match=r"memory\[0\]\[0\] = -1"):
        ShardingProblem.one_each([1.0, 1.0], [0.0, 0.0], [-1, 1])
    with pytest.raises(PlanError, match="joins node 1"):
        ShardingProblem.one_each([1.0, 1.0], [0.0, 0.0], [1, 1], [(1, 1, 0.5)])
    p = ShardingProblem.one_each([1.0, 2.0], [0.0, 0.5], [4, 4], [(0, 1, 0.25)],
                                 [(0, 1, True)], [[0], [0, 1]])
    assert evaluate(p, [0, 0]) == np.inf and peak_memory(p, [0, 0]) == 8.0
