"""Progress records (what a rank runs and waits for) read back as the launcher and the
waiting ranks read them, and collective API calls checked across ranks."""

import numpy as np
import pytest

from distgraph.errors import RuntimeFault
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.launch.progress import NO_PROGRESS, Progress, behind, moment, read_where
from distgraph.runtime.launch.status import RankState, failure_lines


def test_a_record_reads_back_as_step_instruction_and_wait(tmp_path):
    p = Progress(str(tmp_path), 2)
    table = p.table(["op 'matmul' in layer 'fc1'", "op 'relu'", "reshard x: [dp] -> []"])
    assert str(read_where(str(tmp_path), 2)) == \
        "rank 2 is outside a training step, not waiting for any peer"
    p.begin_step(7, table)
    p.at(1)
    assert str(read_where(str(tmp_path), 2)) == \
        "rank 2 is at step 7, op 'relu', not waiting for any peer"
    p.at(2)
    p.wait_begin("all_reduce on group (0, 2)")
    where = read_where(str(tmp_path), 2)
    assert where.state == "waiting" and where.at == "all_reduce on group (0, 2)"
    assert where.step == 7 and where.seconds >= 0
    p.wait_end()
    assert read_where(str(tmp_path), 2).at == "reshard x: [dp] -> []"
    p.end_step()
    with p.phase("Engine.state_dict()"):
        assert read_where(str(tmp_path), 2).phase == "Engine.state_dict()"
    assert read_where(str(tmp_path), 2).phase == ""


def test_status_files_take_precedence(tmp_path):
    Progress(str(tmp_path), 0)
    (tmp_path / "0.done").write_text("")
    assert read_where(str(tmp_path), 0).state == "finished"
    (tmp_path / "1.exit").write_text("killed by signal 9")
    assert str(read_where(str(tmp_path), 1)) == \
        "rank 1 has ended (killed by signal 9) before its first collective"
    assert read_where(str(tmp_path), 3).state == "not started"
    (tmp_path / "0.exit").write_text("exited with code 0")     # beside done: a finish
    assert str(read_where(str(tmp_path), 0)) == \
        "rank 0 has finished its script before its first collective"


def test_moment_says_when_in_the_job_a_rank_is(tmp_path):
    folder = str(tmp_path)
    assert moment(folder, 0) == "before its first collective"
    p = Progress(folder, 0)
    assert moment(folder, 0) == "before its first collective"
    with p.phase("Engine.fit()"):
        p.wait_begin("all_gather on group (0, 1)")
        assert moment(folder, 0) == "while waiting for all_gather on group (0, 1), in Engine.fit()"
        p.wait_end()
        assert moment(folder, 0) == "before its first training step, in Engine.fit()"
        p.begin_step(4, p.table(["op 'relu'"]))
        assert moment(folder, 0) == "in step 4, in Engine.fit()"
        p.end_step()
    assert moment(folder, 0) == "after step 4"
    (tmp_path / "0.done").write_text("sys.exit(0)")
    assert str(read_where(folder, 0)) == "rank 0 ended its script with sys.exit(0) after step 4"


def test_behind_names_the_ranks_that_are_not_waiting_first(tmp_path):
    folder = str(tmp_path)
    records = {r: Progress(folder, r) for r in range(4)}
    tables = {r: p.table(["op 'matmul'", "op 'relu'", "reshard g"]) for r, p in records.items()}
    for r, p in records.items():
        p.begin_step(3, tables[r])
        p.at(2)
        if r != 2:
            p.wait_begin("all_reduce on group (0, 1, 2, 3)")
    records[2].at(1)                               # rank 2 is still computing
    sentence, states = behind(folder, 0, range(4))
    assert sentence == "rank 2 is at step 3, op 'relu', not waiting for any peer"
    assert states == {"computing"}
    records[2].wait_begin("all_gather on group (0, 2)")    # now every rank waits
    sentence, states = behind(folder, 0, range(4))
    assert sentence.startswith("every peer is waiting as well, for different calls: ")
    assert "rank 2 waits (step 3, for " in sentence and "all_gather on group (0, 2)" in sentence
    (tmp_path / "3.failed").write_text("RuntimeFault: ...")
    (tmp_path / "1.done").write_text("")
    sentence, _ = behind(folder, 0, range(4))
    assert sentence == ("rank 1 has finished its script while waiting for all_reduce on "
                        "group (0, 1, 2, 3)")      # (its last record); the failed one: apart
    assert behind(None, 0, range(4)) == ("", set())
    assert not NO_PROGRESS.active and NO_PROGRESS.table(["x"]) == -1


def test_ranks_in_different_collective_calls_fail_at_once():
    def rank(comm):
        name = "Engine.state_dict()" if comm.rank == 0 else "Engine.evaluate()"
        with comm.collective_call(name):
            return "ran"

    with pytest.raises(RuntimeFault, match=r"is collective: call it on every rank; here rank"):
        SimulatedWorld(2).run(rank)

    def same(comm):
        with comm.collective_call("Engine.fit()"), \
                comm.collective_call("Engine.evaluate()"):     # nested: checked once
            return comm.all_reduce(np.ones(1), (0, 1))[0]

    assert SimulatedWorld(2).run(same) == [2.0, 2.0]


def test_a_collective_call_made_on_one_rank_says_so_at_the_timeout():
    def rank(comm):
        if comm.rank == 0:
            with comm.collective_call("Engine.state_dict()"):
                pass

    with pytest.raises(RuntimeFault, match=r"Engine.state_dict\(\) is collective: call it on "
                                           r"every rank"):
        SimulatedWorld(2, timeout=0.5).run(rank)


def test_behind_names_peers_on_other_hosts_with_their_host(tmp_path):
    # Over several hosts a rank reads only its own host's records: ranks 2 and 3 run on
    # node1, and rank 1 (on node0 with rank 0) is computing.
    folder = str(tmp_path)
    records = {r: Progress(folder, r) for r in (0, 1)}
    for r, p in records.items():
        p.begin_step(3, p.table(["op 'matmul'", "op 'relu'"]))
        p.at(1)
    records[0].wait_begin("all_reduce on group (0, 1, 2, 3)")
    hosts = ("node0", "node0", "node1", "node1")
    sentence, states = behind(folder, 0, range(4), hosts)
    assert sentence == ("rank 1 is at step 3, op 'relu', not waiting for any peer; "
                        "ranks 2, 3 on node1 (where they are cannot be read from node0)")
    assert states == {"computing", "elsewhere"}
    records[1].wait_begin("all_reduce on group (0, 1, 2, 3)")
    sentence, _ = behind(folder, 0, range(4), hosts)
    assert sentence.startswith("every peer on this host is waiting as well")
    assert behind(folder, 0, [0, 2], hosts) == (
        "rank 2 on node1 (where it is cannot be read from node0)", {"elsewhere"})


def test_failure_lines_group_ranks_whose_errors_differ_only_by_their_own_name():
    def failed(rank, text):
        return RankState(rank, text, False, None, ())

    states = [failed(0, "RuntimeFault: rank 0 (process 2): timed out waiting for rank 3"),
              failed(1, "RuntimeFault: rank 1 (process 0): timed out waiting for rank 3"),
              failed(2, "RuntimeFault: rank 2: timed out waiting for rank 3"),
              failed(3, "RuntimeFault: rank 0: timed out waiting for rank 3"),
              failed(4, "PlanError: rank 4: no plan"),
              RankState(5, None, False, "killed by signal 9", ()),
              RankState(6, None, True, "exited with code 0", ())]     # it finished
    assert failure_lines(states, moments={5: "in step 2"}) == [
        "ranks 0, 1, 2 failed: RuntimeFault: timed out waiting for rank 3",
        "rank 3 failed: RuntimeFault: rank 0: timed out waiting for rank 3",
        "rank 4 failed: PlanError: rank 4: no plan",
        "rank 5 died without reporting an error (killed by signal 9 in step 2); the other "
        "ranks were stopped after it"]
