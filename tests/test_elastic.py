"""Elastic training (``distgraph run --elastic``): the loop's policy against fakes, then, on
an emulated 2 x 2 cluster (root), a machine lost mid-epoch and the job finishing on the 2
ranks left with the serial run's weights (dp x mp, auto_mode="full", a 2-stage pipeline
that becomes 1 stage); a machine lost while a checkpoint is written; a machine taken back
from the next checkpoint once it answers again (--max-ranks); too few ranks left. The emulated tests skip where namespaces cannot be made."""

import io
import json
import os
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from distgraph.app.checkpoint import metadata_checksum
from distgraph.app.checkpoint_verify import newest
from distgraph.errors import PlanError
from distgraph.resources.cluster import Cluster
from distgraph.runtime.emulate.elastic import subcluster
from distgraph.runtime.emulate.faults import parse_fault
from distgraph.runtime.launch.context import LaunchContext
from distgraph.runtime.launch.elastic import (ElasticPolicy, ElasticRun, Machine, Outcome,
                                              next_world)

ROOT = Path(__file__).resolve().parent.parent
FILE_2X2 = str(ROOT / "resources" / "clusters" / "emulated_2x2.yaml")
SCRIPT = str(ROOT / "tests" / "mpi_scripts" / "elastic_gpt.py")
MACHINES = (Machine("node0", 2), Machine("node1", 2))


# ---- the policy, against fakes -----------------------------------------------------------

def test_next_world_keeps_the_machines_that_answer_in_order_up_to_the_cap():
    policy = ElasticPolicy()
    assert next_world(MACHINES, {"node1"}, policy, 4) == (Machine("node1", 2),)
    assert next_world(MACHINES, {"node0", "node1"}, policy, 3) == \
        (Machine("node0", 2), Machine("node1", 1))
    assert next_world(MACHINES, {"node0", "node1"}, ElasticPolicy(max_ranks=2), 4) == \
        (Machine("node0", 2),)
    assert next_world(MACHINES, set(), policy, 4) == ()


@pytest.mark.parametrize("kwargs", [{"max_restarts": -1}, {"min_ranks": 0},
                                    {"min_ranks": 3, "max_ranks": 2}])
def test_a_policy_that_cannot_hold_is_refused(kwargs):
    with pytest.raises(PlanError):
        ElasticPolicy(**kwargs)


class Fake:
    """Attempts that fail while ``failures`` lasts; machines answer as ``alive`` says."""

    def __init__(self, failures, alive):
        self.failures, self.alive, self.worlds = list(failures), list(alive), []

    def attempt(self, world, restart):
        self.worlds.append((restart, world))
        if self.failures:
            return Outcome(1, self.failures.pop(0), time.time())
        return Outcome(0)

    def answering(self, names):
        return self.alive.pop(0) if self.alive else set(names)


def test_a_lost_machine_is_dropped_and_taken_back_when_it_answers_again(tmp_path):
    fake = Fake(["machine node1 stopped answering", "rank 0 failed: boom"],
                [{"node0"}, {"node0", "node1"}])
    log = io.StringIO()
    records = tmp_path / "elastic.jsonl"
    rc = ElasticRun(MACHINES, 4, fake.attempt, fake.answering, ElasticPolicy(min_ranks=2),
                    log, str(records)).run()
    assert rc == 0
    assert [sum(m.slots for m in w) for _, w in fake.worlds] == [4, 2, 4]
    text = log.getvalue()
    assert "restart 1 of 3 on 2 ranks (node0:2), was 4; dropped node1" in text
    assert "restart 2 of 3 on 4 ranks (node0:2, node1:2), was 2" in text
    assert "finished after 2 restarts (world sizes 4 -> 2 -> 4)" in text
    events = [json.loads(line)["event"] for line in records.read_text().splitlines()]
    assert events == ["start", "failure", "start", "failure", "start"]


def test_below_min_ranks_the_job_ends_with_one_line():
    fake = Fake(["machine node1 stopped answering"], [{"node0"}])
    log = io.StringIO()
    rc = ElasticRun(MACHINES, 4, fake.attempt, fake.answering, ElasticPolicy(min_ranks=3),
                    log).run()
    assert rc == 1 and len(fake.worlds) == 1
    lines = log.getvalue().splitlines()
    assert len(lines) == 1 and "below --min-ranks 3: the job ends" in lines[0]


def test_restarts_run_out():
    fake = Fake(["a", "b", "c"], [])
    log = io.StringIO()
    rc = ElasticRun(MACHINES, 4, fake.attempt, fake.answering,
                    ElasticPolicy(max_restarts=1), log).run()
    assert rc == 1 and len(fake.worlds) == 2
    assert "no restart left (--max-restarts 1)" in log.getvalue()


def test_a_signal_ends_the_job_without_a_restart():
    fake = Fake([], [])
    fake.attempt = lambda world, restart: Outcome(128 + signal.SIGTERM)
    assert ElasticRun(MACHINES, 4, fake.attempt, fake.answering, ElasticPolicy(),
                      io.StringIO()).run() == 128 + signal.SIGTERM


def test_only_a_users_signal_ends_the_job_other_high_exit_codes_restart():
    # mpiexec exits 255 when a host's proxy is gone: a failure, not the user's Ctrl-C
    fake = Fake([], [{"node0"}])
    outcomes = [Outcome(255), Outcome(0)]
    fake.attempt = lambda world, restart: outcomes.pop(0)
    log = io.StringIO()
    assert ElasticRun(MACHINES, 4, fake.attempt, fake.answering, ElasticPolicy(),
                      log).run() == 0
    assert "the job failed (exit code 255); restart 1 of 3 on 2 ranks" in log.getvalue()


def test_a_job_grows_back_only_with_max_ranks_below_it_and_with_a_restart_left():
    assert not ElasticPolicy().may_grow(4, 2, 1)                      # no --max-ranks
    assert ElasticPolicy(max_ranks=4).may_grow(4, 2, 1)
    assert not ElasticPolicy(max_ranks=4).may_grow(4, 4, 1)            # already there
    assert not ElasticPolicy(max_ranks=2).may_grow(4, 2, 1)            # at --max-ranks
    assert not ElasticPolicy(max_ranks=8).may_grow(2, 2, 1)            # never above -n
    assert not ElasticPolicy(max_restarts=1, max_ranks=4).may_grow(4, 2, 1)   # none left


def test_machine_faults_parse_with_a_time_or_a_step():
    f = parse_fault("machine node1 down at step 6 for 3s", ["node0", "node1"])
    assert (f.a, f.b, f.machine, f.step, f.duration) == ("node1", None, True, 6, 3.0)
    f = parse_fault("machine node0 down at 2s", ["node0", "node1"])
    assert (f.at, f.step) == (2.0, None)
    assert parse_fault("link node0-node1 down at step 3", ["node0", "node1"]).step == 3
    with pytest.raises(PlanError, match="not a machine of this job"):
        parse_fault("machine node7 down at 1s", ["node0", "node1"])


def test_the_reduced_cluster_holds_the_machines_left():
    reduced = subcluster(Cluster.from_file(FILE_2X2), [Machine("node1", 2)])
    assert [d.global_id for d in reduced.devices] == [2, 3]
    assert [m.hostname for m in reduced.machines] == ["node1"]


def test_a_link_group_reduces_to_the_devices_left():
    """gpu_2x8's machines hold their 8 GPUs in one NVLink group: node1 with 4 GPUs left
    keeps the group's pairs among them."""
    reduced = subcluster(Cluster.from_file(ROOT / "resources" / "clusters" / "gpu_2x8.yaml"),
                         [Machine("node1", 4)])
    assert [d.global_id for d in reduced.devices] == [8, 9, 10, 11]
    assert (reduced.bandwidth(8, 11), reduced.latency(8, 11)) == (300.0, 2.0)
    assert [g.members for g in reduced.machines[0].links.groups] == [(8, 9, 10, 11)]


def test_a_file_without_links_inside_its_machines_reduces_to_either_machine(tmp_path):
    """The devices of a machine reach each other through its shared memory, whatever the
    file lists: a file the job started with is also a cluster of the machines left (it
    was 'elastic_2x2 reduced to node0: links: devices 1 cannot reach device 0')."""
    data = Cluster.from_file(FILE_2X2).to_dict()
    for machine in data["machines"]:
        del machine["links"]
    started = Cluster.from_dict(data, "elastic_2x2")
    for kept, ids in (("node0", [0, 1]), ("node1", [2, 3])):
        reduced = subcluster(started, [Machine(kept, 2)])
        assert [d.global_id for d in reduced.devices] == ids
        assert reduced.bandwidth(*ids) == started.bandwidth(*ids) == 10.0


def test_the_restart_travels_in_the_launch_context():
    ctx = LaunchContext(restart=2)
    parsed, rest = LaunchContext.parse([*ctx.argv(), "--", "x.py"])
    assert parsed.restart == 2 and rest == ["x.py"]
    assert LaunchContext.inherited(ctx.environ()).restart == 2
    assert LaunchContext().restart is None


def test_newest_chooses_the_complete_checkpoint_with_the_highest_step(tmp_path):
    def fake(name, step, complete=True):
        folder = tmp_path / name
        (folder / "data-1").mkdir(parents=True)
        if complete:
            (folder / "data-1" / "rank-00000.bin").write_bytes(b"x")
        meta = {"format": "distgraph-checkpoint", "version": 2, "data": "data-1",
                "training": {"step": step},
                "files": {"rank-00000.bin": {"bytes": 1, "crc32": f"{zlib.crc32(b'x'):08x}"}},
                "tensors": {"w": {"shards": [{"file": "rank-00000.bin"}]}}}
        meta["checksum"] = metadata_checksum(meta)
        (folder / "metadata.json").write_text(json.dumps(meta))

    fake("ckpt-4", 4)
    fake("ckpt-8", 8)
    fake("ckpt-12", 12, complete=False)            # its files are not all there
    (tmp_path / "ckpt-16").mkdir()                 # a save killed before its metadata
    path, skipped = newest(str(tmp_path / "ckpt-{step}"))
    assert path == str(tmp_path / "ckpt-8")
    assert [v.path for v in skipped] == [str(tmp_path / "ckpt-12")]
    assert "rank-00000.bin is missing" in str(skipped[0])
    assert newest(str(tmp_path / "ckpt-4")) == (str(tmp_path / "ckpt-4"), [])
    path, skipped = newest(str(tmp_path / "ckpt-16"))
    assert path is None and skipped[0].absent


# ---- on an emulated cluster (root) --------------------------------------------------------

from test_emulate import REASON  # noqa: E402  (skips where namespaces cannot be made)

EMULATED = pytest.mark.skipif(REASON is not None, reason=f"emulated clusters: {REASON}")


@pytest.fixture
def launched():
    from test_emulate import Launcher
    launcher = Launcher()
    try:
        yield launcher
    finally:
        left = launcher.cleanup()
    assert left == [], f"the job left namespaces behind: {left}"


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    out = tmp_path_factory.mktemp("serial") / "w.npz"
    subprocess.run([sys.executable, SCRIPT, "--out", str(out)], check=True,
                   env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
    return dict(np.load(out))


def processes_mentioning(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def assert_equal_weights(path, serial):
    got = dict(np.load(path))
    assert sorted(got) == sorted(serial)
    worst = max(float(np.max(np.abs(got[k] - serial[k]))) for k in serial)
    assert worst < 1e-10, worst


def elastic(tmp_path, *extra, faults=("machine node1 down at step 6",), script=(),
            file=FILE_2X2):
    args = ["run", "-n", "4", "--emulate", str(file), "--elastic", "--min-ranks", "2",
            "--log-dir", str(tmp_path / "logs")]
    for fault in faults:
        args += ["--emulate-fault", fault]
    return [*args, *extra, SCRIPT, "--ckpt", str(tmp_path / "ckpt"), "--out",
            str(tmp_path / "w.npz"), *script]


@pytest.mark.mpi
@pytest.mark.slow
@EMULATED
@pytest.mark.parametrize("mode", [[], ["--auto"], ["--pipeline"]],
                         ids=["dp-x-mp", "auto-full", "pipeline-2-stages-to-1"])
def test_a_machine_lost_mid_epoch_the_job_finishes_on_the_ranks_left(launched, tmp_path,
                                                                      serial, mode):
    # --pipeline: 2 stages of a 2-process "mp" mesh each, 2 micro-batches; on the 2 ranks
    # left the script's rule (world // 2 stages) makes it 1 stage (elastic_gpt.py)
    script = ["--step-time", "0.2", *mode]
    result = launched.run(*elastic(tmp_path, script=script), timeout=300)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert "machine node1 down" in err
    assert "restart 1 of 3 on 2 ranks (node0:2), was 4; dropped node1" in err
    assert "resumed from" in err and "finished after 1 restart (world sizes 4 -> 2)" in err
    steps = [ln.split() for ln in out.splitlines() if ln.startswith("STEP ")]
    worlds = {int(s[2]): s[3] for s in steps}              # the last world of each step
    assert sorted(worlds) == list(range(24)) and worlds[23] == "world=2"
    assert "DONE world=2 step=24" in out
    plans = [ln.split() for ln in out.splitlines() if ln.startswith("PLAN ")]
    assert [p[1] for p in plans] == ["world=4", "world=2"]
    if "--pipeline" in mode:
        assert [p[2] for p in plans] == ["stages=2", "stages=1"]
    assert_equal_weights(tmp_path / "w.npz", serial)
    assert processes_mentioning(str(tmp_path)) == []
    records = [json.loads(ln) for ln in (tmp_path / "logs" / "elastic.jsonl").open()]
    assert [r["world"] for r in records if r["event"] == "start"] == [4, 2]


@pytest.mark.mpi
@pytest.mark.slow
@EMULATED
def test_a_file_without_links_inside_its_machines_restarts_on_the_machine_left(
        launched, tmp_path, serial):
    """The user's file of issue #52 (every device linked to the other machine's, none
    inside a machine) started, then lost node1: the restart died planning on node0
    ('links: devices 1 cannot reach device 0')."""
    import yaml

    data = Cluster.from_file(FILE_2X2).to_dict()
    for machine in data["machines"]:
        del machine["links"]
    file = tmp_path / "elastic_2x2.yaml"
    file.write_text(yaml.safe_dump({**data, "name": "elastic_2x2"}))
    result = launched.run(*elastic(tmp_path, file=file, script=["--step-time", "0.2"]),
                          timeout=300)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert "restart 1 of 3 on 2 ranks (node0:2), was 4; dropped node1" in err
    assert "finished after 1 restart (world sizes 4 -> 2)" in err
    assert "DONE world=2 step=24" in out
    assert_equal_weights(tmp_path / "w.npz", serial)


@pytest.mark.mpi
@pytest.mark.slow
@EMULATED
def test_a_successful_elastic_job_removes_its_temporary_logs_failed_attempts_included(
        launched, tmp_path):
    """Issue #52: without --log-dir each attempt kept its own temporary log folder when
    it failed (a machine lost), though the job then succeeded on the ranks left."""
    temp = tmp_path / "temp"
    temp.mkdir()
    args = elastic(tmp_path, script=["--step-time", "0.2"])
    at = args.index("--log-dir")
    del args[at:at + 2]
    result = launched.run(*args, env={"TMPDIR": str(temp)}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "restart 1 of 3 on 2 ranks (node0:2), was 4; dropped node1" in result.stderr
    assert not [p.name for p in temp.iterdir() if p.name.startswith("distgraph-logs-")]


@pytest.mark.mpi
@pytest.mark.slow
@EMULATED
def test_a_machine_lost_while_a_checkpoint_is_written_resumes_from_the_previous_one(
        launched, tmp_path, serial):
    proc = launched.start(*elastic(tmp_path, faults=(), script=["--hold-save-at", "8"]))
    for line in proc.stdout:               # node1's ranks hold before the save at step 8
        if line.startswith("HOLD"):
            break
    ckpt = tmp_path / "ckpt"
    deadline = time.monotonic() + 30       # node0's ranks write their shards and wait
    while not list(ckpt.glob(".tmp-*/rank-*.bin")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(ckpt.glob(".tmp-*/rank-*.bin")), sorted(os.listdir(ckpt))
    saved = json.loads((ckpt / "metadata.json").read_text())
    assert saved["training"]["step"] == 4
    machine = [n for n in launched.namespaces_of(proc) if n.endswith("-m1")][0]
    pids = subprocess.run(["ip", "netns", "pids", machine], capture_output=True,
                          text=True).stdout.split()
    for pid in pids:
        os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "-n", machine, "link", "set", "dg0", "down"], check=True)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert f"resumed from {tmp_path / 'ckpt'} at step 4" in err
    assert "dropped node1" in err
    assert_equal_weights(tmp_path / "w.npz", serial)
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.mpi
@pytest.mark.slow
@EMULATED
def test_a_machine_that_answers_again_is_taken_back_from_the_next_checkpoint(
        launched, tmp_path, serial):
    args = elastic(tmp_path, "--max-ranks", "4", faults=("machine node1 down at step 6 for 5s",),
                   script=["--step-time", "0.2"])
    result = launched.run(*args, timeout=300)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert "restart 1 of 3 on 2 ranks (node0:2), was 4; dropped node1" in err
    grown = [ln for ln in err.splitlines() if "elastic: machine node1 answers again" in ln]
    assert len(grown) == 1 and "machine node1 answers again; growing from the checkpoint " \
        "of step" in grown[0] and "restart 2 of 3 on 4 ranks (node0:2, node1:2), was 2" \
        in grown[0], err[-3000:]
    step = int(grown[0].split("checkpoint of step ")[1].split(";")[0])
    assert f"resumed from {tmp_path / 'ckpt'} at step {step}" in err
    assert "finished after 2 restarts (world sizes 4 -> 2 -> 4)" in err
    assert "DONE world=4 step=24" in out
    assert_equal_weights(tmp_path / "w.npz", serial)
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.mpi
@pytest.mark.slow
@EMULATED
def test_below_min_ranks_the_job_stops_with_one_line(launched, tmp_path):
    args = elastic(tmp_path, script=["--step-time", "0.2"])
    args[args.index("--min-ranks") + 1] = "3"
    result = launched.run(*args, timeout=240)
    assert result.returncode != 0
    lines = [ln for ln in result.stderr.splitlines() if "elastic:" in ln]
    assert len(lines) == 1, result.stderr[-3000:]
    assert "2 ranks left on the machines that answer (node0:2), below --min-ranks 3" \
        in lines[0]
    assert processes_mentioning(str(tmp_path)) == []


# ---- the checkpoint interval (Young/Daly) -------------------------------------------------

def test_young_daly_minimises_the_time_lost():
    from distgraph.passes import young_daly
    c = young_daly(step_s=0.5, save_s=2.0, mtbf_s=24 * 3600)
    assert c.seconds == pytest.approx((2 * 2.0 * 24 * 3600) ** 0.5)
    assert c.steps == round(c.seconds / 0.5)
    # the overhead at the optimum is below its value at half and at twice the interval
    for steps in (c.steps // 2, c.steps * 2):
        other = type(c)(steps, steps * 0.5, 0.5, 2.0, 24 * 3600)
        assert c.overhead < other.overhead
    with pytest.raises(PlanError, match="positive save time"):
        young_daly(0.5, 0.0, 3600)


def test_the_plan_proposes_a_checkpoint_interval_from_its_estimate():
    import distgraph as dg
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=32, d_model=16, n_layer=2, n_head=2, max_seq_len=8)
    strategy = dg.Strategy(mtbf_hours=10.0, checkpoint_write_gbps=0.5)
    engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-3),
                       strategy=strategy, cluster=Cluster.from_file(FILE_2X2))
    plan = engine.prepare([dg.InputSpec([8, 8], "int64", "tokens")],
                          [dg.InputSpec([8, 8], "int64", "labels")])
    c = plan.checkpoint
    busiest = max(p.parameters + p.states for p in plan.estimate.processes)
    assert c.save_s == pytest.approx(busiest / 0.5e9)
    assert c.step_s == plan.estimate.step_time and c.mtbf_s == 36000.0
    assert c.seconds == pytest.approx((2 * c.save_s * 36000.0) ** 0.5)
    assert f"checkpoint every {c.steps} steps" in plan.explain()
    assert plan.to_dict()["checkpoint"]["steps"] == c.steps


def test_elastic_without_machines_to_lose_is_one_line(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("print('hi')\n")
    result = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                             "--elastic", str(script)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "distgraph run: --elastic needs machines to lose and take back: give --hostfile "
        "FILE, --hosts LIST or --emulate FILE, or run it in a Slurm allocation"]


@pytest.mark.parametrize("options, said", [
    (["--max-ranks", "4"], "--max-ranks"),
    (["--min-ranks", "2", "--max-restarts", "1"], "--max-restarts, --min-ranks")])
def test_elastic_options_without_elastic_are_refused_not_ignored(tmp_path, options, said):
    script = tmp_path / "x.py"
    script.write_text("print('hi')\n")
    result = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "2",
                             *options, str(script)], capture_output=True, text=True)
    assert result.returncode == 2 and "hi" not in result.stdout
    assert result.stderr.strip().splitlines() == [
        f"distgraph run: {said} only bend an elastic job: add --elastic (with --emulate, "
        "--hostfile or --hosts), or leave them out"]


def test_max_ranks_below_the_ranks_asked_for_is_refused_before_any_rank_starts(tmp_path):
    script = tmp_path / "x.py"
    script.write_text("print('hi')\n")
    result = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                             "--elastic", "--max-ranks", "2", "--hosts", "localhost:4",
                             str(script)], capture_output=True, text=True)
    assert result.returncode == 2 and "hi" not in result.stdout
    assert result.stderr.strip().splitlines() == [
        "distgraph run: --max-ranks 2 is below -n 4: the job would start on 2 ranks; "
        "give -n 2, or --max-ranks 4 or more"]


RESTARTED_FIT = """
import numpy as np, sys
import distgraph as dg
class Rows:
    def __len__(self): return 8
    def __getitem__(self, i): return np.full(4, i, "float64"), np.int64(i % 2)
model = dg.nn.MLP(4, 8, 2)
engine = dg.Engine(model, loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.SGD(0.1))
cbs = [dg.callbacks.ModelCheckpoint(sys.argv[1], every_n_steps=2)] if len(sys.argv) > 1 else []
engine.fit(Rows(), batch_size=4, verbose=0, callbacks=cbs)
"""


@pytest.mark.parametrize("checkpoint", [False, True], ids=["no-callback", "empty-folder"])
def test_a_restarted_fit_with_nothing_to_resume_from_says_it_starts_over(tmp_path, checkpoint):
    script = tmp_path / "fit.py"
    script.write_text(RESTARTED_FIT)
    extra = [str(tmp_path / "ckpt")] if checkpoint else []
    result = subprocess.run([sys.executable, str(script), *extra], capture_output=True,
                            text=True, env=dict(os.environ, DISTGRAPH_ELASTIC_RESTART="1"))
    assert result.returncode == 0, result.stderr
    said = [ln for ln in result.stderr.splitlines() if ln.startswith("distgraph: elastic")]
    if checkpoint:                        # ModelCheckpoint's own line, not a second one
        assert said == ["distgraph: elastic restart 1 on 1 ranks: no complete checkpoint at "
                        f"{tmp_path / 'ckpt'}: starting from step 0"]
    else:
        assert said == ["distgraph: elastic restart 1 on 1 ranks: no checkpoint was loaded "
                        "and the fit has no ModelCheckpoint, so training starts over from "
                        "step 0 (add dg.callbacks.ModelCheckpoint(path, every_n_steps=k) to "
                        "resume from the last one)"]
