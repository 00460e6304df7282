"""Pipelines on real MPI ranks (``python -m distgraph.cli run``, the ``distgraph run`` command):
a sample of plans and schedules (interleaved and V-shaped ones too) trains like serial
full-batch training on 2 and 4 ranks (stages placed by shard_op, and by parameter
annotations alone, fewer micro-batches than stages among them), every rank runs its tasks
in the plan's order, and a failing task or a message that never arrives ends the job
naming the rank and the task."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_failures import DEADLINE, launch

SCRIPT = Path(__file__).parent / "mpi_scripts" / "train_pipeline.py"
TOLERANCE = 1e-10
TWO = ["mlp:two_stage:8:1F1B", "gpt:two_stage:4:ZB", "gpt:two_stage:2:FThenB",
       "gpt:layered:4:1F1B:2", "gpt:layered:4:ZBV", "mlp4:layered:8:ZB:2", "mlp4:layered:8:ZBV",
       # stages from parameter annotations alone (tests/test_pipeline_stages.py)
       "gpt:param2:4:1F1B", "mlp:param2:8:FThenB", "gpt:param2:4:1F1B:2", "gpt:param2:4:ZBV",
       "gpt:param2:1:ZB"]
FOUR = ["gpt:four_stage:8:1F1B", "gpt:two_stage_tp:4:ZB", "mlp:two_stage:8:FThenB",
        "mlp4:four_stage:4:ZB", "gpt6:layered:8:1F1B:2", "gpt6:layered:8:ZBV",
        "mlp8:layered:8:1F1B:2", "mlp8:layered:8:ZBV",
        "gpt:param4:2:ZB", "gpt:param2_dp:8:1F1B", "gpt:param2_mp:4:FThenB",
        "gpt6:param4:8:1F1B:2", "mlp8:param4:8:ZBV", "gpt6:param4:2:ZB:2",
        "gpt:param2_dp:4:ZBV", "gpt:param2_mp:4:1F1B:2"]


def run_items(nprocs, items):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs), str(SCRIPT),
                           *items], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PIPELINE-RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


def check(report, nprocs, items):
    assert report["world"] == nprocs and sorted(report["runs"]) == sorted(items)
    for item, run in report["runs"].items():
        kind, name, m, schedule, *virtual = item.split(":")
        m = int(m)
        stages = 4 if name in ("four_stage", "param4") else nprocs if name == "layered" else 2
        chunks_per_stage = 2 if virtual or schedule == "ZBV" else 1
        for rank, mine in enumerate(run["ranks"]):
            assert mine["losses"] == run["ranks"][0]["losses"], f"{item}: rank {rank} differs"
            assert mine["errors"]["loss"] <= TOLERANCE, (item, rank, mine["errors"])
            assert mine["errors"]["param"] <= TOLERANCE, (item, rank, mine["errors"])
        for rank_s, order in run["order"].items():
            rank = int(rank_s)
            stage = rank if stages == nprocs else rank * stages // nprocs
            kinds = [k for _, k, _ in order]
            assert kinds[-1] == "update"
            assert order[:-1] == run["schedule"][rank_s], (item, rank)   # the plan's order
            if chunks_per_stage > 1:        # each rank runs its two chunks
                chunks = {c for c, k, _ in order if k == "forward"}
                assert chunks == ({stage, 2 * stages - 1 - stage} if schedule == "ZBV" else
                                  {stage, stage + stages}), (item, rank, chunks)
                continue
            if schedule == "FThenB":
                assert kinds[:m] == ["forward"] * m, (item, rank, order)
            if schedule == "1F1B" and stage == stages - 1:
                assert kinds[:-1] == ["forward", "backward"] * m, (item, rank, order)
            cap = m if schedule == "FThenB" else min(m, stages if schedule == "ZB" else
                                                     stages - stage)
            assert run["peak"][rank_s][1] <= cap, (item, rank, run["peak"])


@pytest.mark.mpi
@pytest.mark.slow
def test_pipelines_on_two_mpi_ranks():
    check(run_items(2, TWO), 2, TWO)


@pytest.mark.mpi
@pytest.mark.slow
def test_pipelines_on_four_mpi_ranks():
    check(run_items(4, FOUR), 4, FOUR)


@pytest.mark.mpi
def test_a_failing_pipeline_task_ends_the_job_naming_rank_and_task():
    rc, out, seconds = launch(2, "pipe_raise")
    assert rc != 0 and seconds < DEADLINE
    assert "rank 0 failed" in out, out[-3000:]
    assert "task forward of chunk 0, micro-batch 0 in step 1" in out, out[-3000:]
    assert "op 'relu'" in out and "injected failure" in out, out[-3000:]


@pytest.mark.mpi
def test_a_pipeline_message_that_never_arrives_is_a_runtime_fault():
    rc, out, seconds = launch(2, "pipe_skip", DISTGRAPH_COMM_TIMEOUT="5")
    assert rc != 0 and seconds < DEADLINE
    assert "RuntimeFault" in out and "rank 0 failed" in out, out[-3000:]
    # rank 1 left: rank 0 gives up within seconds, naming what it waited for
    assert "messages from rank 1 for backward micro-batch 0" in out, out[-3000:]
    assert "rank 1 has finished its script" in out, out[-3000:]
