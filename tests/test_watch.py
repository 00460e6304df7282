"""The launcher's watch over its ranks, read from status files as the ranks' bootstrap and
supervisors write them: which endings stop a job, after how long, in which words. (The
same endings on real ranks: tests/test_rank_endings.py.)"""

import time

import pytest

from distgraph.runtime.launch import watch as watch_module
from distgraph.runtime.launch.progress import Progress
from distgraph.runtime.launch.watch import RankWatch


@pytest.fixture
def folder(tmp_path):
    for rank in range(3):
        (tmp_path / f"{rank}.mpi").write_text("running")
    return tmp_path


def test_ranks_that_run_or_finish_stop_nothing(folder):
    watch = RankWatch(str(folder), 3, timeout=0.0)
    (folder / "1.done").write_text("")
    (folder / "1.exit").write_text("exited with code 0")       # finished, then gone
    (folder / "2.done").write_text("sys.exit(0)")             # finished, in MPI_Finalize
    assert watch() is None and watch.reason is None


def test_a_rank_gone_without_a_word_stops_the_job_after_a_moment(folder, monkeypatch):
    monkeypatch.setattr(watch_module, "SETTLE", 0.2)
    progress = Progress(str(folder), 2)
    progress.begin_step(5, progress.table(["op 'relu'"]))
    (folder / "2.exit").write_text("exited with code 0")
    watch = RankWatch(str(folder), 3, timeout=None)
    assert watch() is None                     # hydra may be ending the job itself
    time.sleep(0.25)
    # the words of the report when hydra ends such a job itself: the same either way
    assert watch() == watch.reason == ("rank 2 died without reporting an error (exited "
                                       "with code 0 in step 5); the other ranks were "
                                       "stopped after it")


def test_a_failed_rank_gets_its_grace_to_abort_the_job_itself(folder, monkeypatch):
    monkeypatch.setattr(watch_module, "FAILED_GRACE", 0.2)
    (folder / "0.failed").write_text("RuntimeError: boom\nsecond line")
    watch = RankWatch(str(folder), 3, timeout=None)
    assert watch() is None
    time.sleep(0.25)
    assert watch() == ("rank 0 failed (RuntimeError: boom) and the job did not end within "
                       "0.2 s")


def test_a_wait_in_mpis_start_past_the_timeout_names_who_never_came(folder):
    (folder / "0.mpi").write_text("starting")
    (folder / "2.mpi").unlink()
    watch = RankWatch(str(folder), 3, timeout=0.1)
    assert watch() is None
    time.sleep(0.15)
    assert watch() == ("rank 0 waited 0.1 s for MPI to start on every rank "
                       "(DISTGRAPH_COMM_TIMEOUT) and rank 2 never began it")
    started = RankWatch(str(folder), 3, timeout=0.1)
    (folder / "0.mpi").write_text("running")           # MPI started meanwhile: no fault
    started()
    time.sleep(0.15)
    assert started() is None
    assert RankWatch(str(folder), 3, timeout=None)() is None     # no bound: none
