"""The plan is the contract the runtime reads: made whole by the planner, read as it is.

- A traced ``fit`` enters no planner module (``distgraph.passes``) once its plan is made:
  no partition, no gather planning, no W batching at run time (data parallel, and a
  two-stage pipeline with micro-batches, on simulated ranks).
- The plan holds plain values: its local and compiled programs are the contract's
  classes, not the planner's lazy partitions; a process it was not asked to compile is
  a clear error, not a pass run on demand.
- Importing the MPI communicator loads the core and the contract, not the planner.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import MappingProxyType

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import PlanError  # noqa: E402
from distgraph.plan.local import LocalProgram  # noqa: E402
from distgraph.plan.program import ProcessProgram  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import plans as P  # noqa: E402

MAX_COMM_MODULES = 20      # issue 31: ``import distgraph.runtime.comm.mpi`` loads <= 20


def _traced_fit(comm, kind, name, strategy):
    """Plan on this rank, then fit one epoch with every Python call traced: the modules
    entered after the plan was made."""
    model = P.build_model(kind)
    P.PLANS[kind, name, comm.size].annotate(model)
    engine = dg.Engine(model, P.loss_fn(kind), P.make_optimizer("adamw"),
                       strategy=strategy, communicator=comm)
    P.prepare(engine, kind)
    entered: set = set()

    def profile(frame, event, arg):
        if event == "call":
            entered.add(frame.f_globals.get("__name__", "?"))

    sys.setprofile(profile)          # this thread only
    try:
        history = engine.fit(P.Dataset(kind), batch_size=P.BATCH, epochs=1, verbose=0)
    finally:
        sys.setprofile(None)
    return entered, history.losses


@pytest.mark.parametrize("kind, name, strategy", [
    ("mlp", "dp", dg.Strategy()),
    ("gpt", "two_stage", dg.Strategy(micro_batches=2, schedule="1F1B")),
], ids=["dp", "pipeline"])
def test_a_traced_fit_enters_no_planner_module_after_the_plan_is_made(kind, name, strategy):
    results = SimulatedWorld(2, timeout=60).run(_traced_fit, kind, name, strategy)
    for rank, (entered, losses) in enumerate(results):
        assert len(losses) == P.STEPS and losses == results[0][1]
        assert "distgraph.runtime.execution.carrier" in entered     # the trace saw the step
        planner = sorted(m for m in entered if m.startswith("distgraph.passes"))
        assert not planner, f"rank {rank} entered the planner while training: {planner}"


def _whole_plan(kind, name, n, **strategy):
    model = P.build_model(kind)
    P.PLANS[kind, name, n].annotate(model)
    ins, labels = dg.app.data.DataLoader(P.Dataset(kind), P.BATCH).specs(1)
    built = build_program(model, ins, labels, P.loss_fn(kind), P.make_optimizer("sgd"))
    return built, dg.Strategy(**strategy)


def test_the_plan_holds_plain_values_made_by_the_planner():
    built, strategy = _whole_plan("gpt", "dp_tp", 4, micro_batches=2)
    plan = dg.passes.plan(built, strategy)
    assert isinstance(plan.locals, MappingProxyType) and isinstance(plan.programs,
                                                                   MappingProxyType)
    assert sorted(plan.programs) == list(plan.process_ids)
    for pid in plan.process_ids:
        program = plan.program_of(pid)
        assert isinstance(program, ProcessProgram) and program.process == pid
        assert isinstance(plan.local(pid), LocalProgram) and program.local is plan.local(pid)
        assert [str(a) for a in program.actions] == [str(a) for a in plan.schedule()[pid]]
        assert {f.name for f in program.feeds} == \
            {v.name for v in plan.local(pid).program.inputs}
        # every persistable can be brought whole: a point per name, planned here
        assert set(program.state_gathers) == {v.name for v in plan.program.persistables}
    # the processes of one group differ only in their coordinates
    for group in plan.groups:
        shapes = {tuple(tuple(v.shape) for v in plan.local(q).program.values.values())
                  for q in group}
        assert len(shapes) == 1


def test_a_plan_for_one_rank_compiles_that_rank_only_and_says_so_for_others():
    built, strategy = _whole_plan("mlp", "dp", 2)
    plan = dg.passes.plan(built, strategy, ranks=(1,))
    assert sorted(plan.programs) == [1]
    assert plan.program_of(1).rank == 1
    with pytest.raises(PlanError, match="process 0's program was not compiled"):
        plan.program_of(0)
    with pytest.raises(PlanError, match="has no part in this plan"):
        plan.local(7)
    # printing needs no more than one process per group
    assert "reshards:" in plan.explain(full=True) and json.loads(plan.to_json())["processes"] == [0, 1]


def test_importing_the_mpi_communicator_loads_the_core_and_the_contract_only():
    out = subprocess.run([sys.executable, "-c", "import json, sys\n"
                          "import distgraph.runtime.comm.mpi\n"
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True).stdout
    loaded = [m for m in json.loads(out.splitlines()[-1])
              if m == "distgraph" or m.startswith("distgraph.")]
    assert not [m for m in loaded if m.startswith("distgraph.passes")], loaded
    assert len(loaded) <= MAX_COMM_MODULES, loaded
