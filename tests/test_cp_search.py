"""The stage search considers context parallelism (issue 34, "Planned at scale").

Llama-tiny (tests/cp_search_cases.py) on one machine of 4 devices, searched with
``Strategy(auto_mode="full", pipeline=True)``:

- **long sequences** (micro-batches of 2 sequences of 512): under a memory budget that
  no stage plan of the search's keeping the sequence whole meets (the stage DP on those
  options finds none), the search splits the sequence of attention and of every
  activation through the blocks over the mesh dims beside the batch's (a ``cp`` dim of
  the (dp, cp, tp) logical meshes), the plan fits, and it trains as the serial program
  does (float64, 1e-10) on SimulatedWorld threads and on 4 real MPI ranks;
- **short sequences** (the same tokens as micro-batches of 8): the rows cover the devices
  and nothing splits the sequence (cp = 1);
- the options: a (dp, cp, tp) shape beside each (x, t) whose x the rows cannot fill,
  dp = gcd(x, rows), its ``cp`` dim offering only sequence splits and its ``x`` only
  splits of the samples.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import cp_search_cases as C  # noqa: E402


def _sequence_split(plan, seq: int) -> dict:
    """{forward op type: [entry of the sequence dim, ...]} of attention (q's dim 2) and
    the decoder layers' norms and matmuls (dim 1 of their results)."""
    found: dict = {}
    for op in plan.program.ops:
        if str(op.role) != "forward" or not op.layer.startswith("layers."):
            continue
        if op.type == "attention":
            found.setdefault(op.type, []).append(op.dist_attr.input_specs[0].entry(2))
        elif op.type in ("rms_norm", "matmul") and op.outputs[0].shape[1] == seq:
            found.setdefault(op.type, []).append(op.dist_attr.output_specs[0].entry(1))
    return found


def _serial(built, values):
    plan = dg.passes.plan(built, dg.Strategy())
    return SimulatedWorld(1).run(lambda comm: C.train(plan, built, values, comm))[0]


@pytest.fixture(scope="module")
def long_plan():
    before = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        yield C.search_plan(*C.LONG, budget_gb=C.BUDGET_GB)
    finally:
        dg.set_default_dtype(before)


def test_no_stage_plan_keeping_the_sequence_whole_fits_the_budget(float64):
    with pytest.raises(dg.PlanError, match="fits the devices' memory"):
        C.unsplit_stage_plan(*C.LONG, C.BUDGET_GB)
    # the oracle can fit with more room (4x: the attention's workspace, the score
    # blocks of the whole sequence, is counted beside its activations)
    plan, chosen = C.unsplit_stage_plan(*C.LONG, 4 * C.BUDGET_GB)
    assert plan.stages and chosen


def test_long_sequence_under_the_budget_splits_the_sequence(float64, long_plan):
    plan, built, _ = long_plan
    assert plan.estimate.peak_memory <= C.BUDGET_GB * 1e9
    seq = C.LONG[1]
    split = _sequence_split(plan, seq)
    assert set(split) == {"attention", "rms_norm", "matmul"}
    cps = {entry for entries in split.values() for entry in entries}
    assert len(cps) == 1                       # one sequence split through the blocks
    (entry,) = cps
    mesh = plan.stages[0]
    cp = int(np.prod([mesh.dim_size(m) for m in entry]))
    assert cp > 1
    # attention runs context parallel: its collectives inside the op, on cp processes
    inside = [line for line in plan.op_collectives() if line.startswith("attention")]
    groups = {line.split(" over (")[1].split(")")[0] for line in inside}
    assert groups and all(len(g.split(",")) == cp for g in groups)
    rows = C.LONG[0] // C.MICRO                # the batch takes the rest of the devices
    assert cp * min(rows, mesh.size // cp) == mesh.size


def test_long_sequence_plan_trains_as_serial(float64, long_plan):
    plan, built, values = long_plan
    serial = _serial(built, values)
    C.L.trains_equal(SimulatedWorld(4, timeout=300).run(lambda comm: C.train(plan, built, values, comm)),
           serial)


def test_short_sequence_keeps_the_sequence_whole(float64):
    plan, _, _ = C.search_plan(*C.SHORT)
    split = _sequence_split(plan, C.SHORT[1])
    assert split and all(entry == () for entries in split.values() for entry in entries)
    assert not any(line.startswith("attention") for line in plan.op_collectives())
    assert all("cp" not in mesh.dim_names for mesh in plan.stages)


def test_options_offer_dp_cp_tp_where_the_rows_cannot_fill_x(float64):
    """8 rows a micro-batch: x = 16 gives (8, 2, t); x = 8 and x = 24 (gcd 8, cp 3 does not
    divide the sequence of 512) give none; 1 row gives none (x's own search may split
    the sequence)."""
    import dataclasses

    from distgraph.passes.pipeline.accumulate import split_micro_batches
    from distgraph.passes.search.stages.layers import block_layers
    from distgraph.passes.search.stages.runs import RunCosts
    from distgraph.passes.search.layouts.space import logical_dims

    built, _ = C.built_program(32, 512)
    built, _ = split_micro_batches(built, C.MICRO)
    prepared = dataclasses.replace(built, program=built.program.clone())
    costs = RunCosts(prepared, C.strategy(), C.cluster(), block_layers(prepared.program,
                                                                    prepared.block_paths), C.MICRO)
    assert [costs._sequence_split(x) for x in (16, 8, 24, 4)] == [2, 1, 1, 1]
    assert logical_dims((8, 2, 4)) == ["x", "cp", "y"]


def test_a_dp_cp_tp_mesh_splits_cp_along_the_sequence_and_x_along_the_samples(float64):
    """Every layout the search offers on a (dp, cp, tp) mesh splits ``cp`` only along
    dims as long as the sequence and ``x`` only along dims as long as the micro-batch's
    rows (Megatron's cp and dp), and every op still has a choice; on the (x, y) mesh of
    as many devices ``x`` splits other dims too (what the rule takes away there)."""
    from distgraph.passes.pipeline.accumulate import split_micro_batches
    from distgraph.passes.search.layouts.space import SearchSpace, logical_dims

    built, _ = split_micro_batches(C.built_program(*C.LONG)[0], C.MICRO)
    program = built.program
    rows, seq = program.inputs[0].shape[:2]

    def lengths(shape) -> dict:
        """{mesh dim: the lengths of the tensor dims it splits} over every offer."""
        mesh = dg.ProcessMesh(np.arange(int(np.prod(shape))).reshape(shape).tolist(),
                              dim_names=logical_dims(shape))
        space = SearchSpace(program, mesh)
        found: dict = {}
        for node in space.nodes:
            assert node.strategies, node.label
            if node.op is None:
                shapes = [program.values[node.value].shape]
            else:
                op = program.ops[node.op]
                shapes = [v.shape for v in op.inputs + op.outputs]
            for s, hint in zip(node.strategies, node.hints):
                specs = list(s.in_specs) + list(s.out_specs) if node.op is not None \
                    else list(s.out_specs)
                for spec, tensor in zip(specs + list(hint), shapes + shapes[-len(hint):]):
                    for d, n in enumerate(tensor):
                        for dim in spec.entry(d):
                            found.setdefault(dim, set()).add(n)
        return found

    three = lengths((2, 2, 2))
    assert three["cp"] == {seq} and three["x"] == {rows} and len(three["y"]) > 2
    assert len(lengths((2, 4))["x"]) > 2


@pytest.mark.mpi
def test_long_sequence_plan_trains_as_serial_on_mpi_ranks(float64, long_plan, tmp_path):
    """Real ranks (``distgraph run -n 4``): each plans the same search and trains."""
    _, built, values = long_plan
    serial = _serial(built, values)
    here = os.path.dirname(os.path.abspath(__file__))
    out = tmp_path / "cp_search.npz"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           os.path.join(here, "mpi_scripts", "cp_search.py"), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = np.load(out)
    C.L.trains_equal([(got["losses"], {name: got[name] for name in serial[1]})], serial)


@pytest.mark.parametrize("case, budget_gb", [(C.LONG, C.BUDGET_GB), (C.LONG, 2 * C.BUDGET_GB),
                                             (C.LONG, None), (C.SHORT, None)])
def test_variants_searched_in_stages_keep_the_plan_of_every_variant(float64, case, budget_gb):
    """plan_blocks searches the (x, t) meshes' variants, then the (dp, cp, tp) meshes and
    their variants only where their alike stages beat the plan found: its objective is
    the stage DP's on every option with every variant searched."""
    import dataclasses

    from distgraph.passes.pipeline.accumulate import split_micro_batches
    from distgraph.passes.search.stages.block_plans import plan_blocks
    from distgraph.passes.search.stages.layers import block_layers
    from distgraph.passes.search.stages.run_dp import plan_runs
    from distgraph.passes.search.stages.runs import RunCosts
    from distgraph.passes.search.stages.pipeline import _capped

    built, _ = C.built_program(*case)
    built, _ = split_micro_batches(built, C.MICRO)
    machine = C.cluster()
    target = machine if budget_gb is None else _capped(machine, budget_gb)

    def costs():
        prepared = dataclasses.replace(built, program=built.program.clone())
        return RunCosts(prepared, C.strategy(), machine,
                        block_layers(prepared.program, prepared.block_paths), C.MICRO)

    staged = costs()
    plan, _ = plan_blocks(staged, target, micro_batches=C.MICRO)
    every = costs()
    oracle, _ = plan_runs(every.layering.count, every.layering.blocks,
                          every.options(variants=True), target, C.MICRO,
                          p2p=every.p2p_seconds)
    assert plan.objective == pytest.approx(oracle.objective, rel=1e-9)
    assert every.searches >= staged.searches
