"""Plans as files (distgraph/plan/file.py, passes/plan_file.py): saved, loaded, checked.

Oracles: a plan loaded from its file equals the plan saved (estimate, stages,
micro-batches, completed program, schedule, and the file it saves again); training under
a loaded plan on 4 real MPI ranks equals serial training (float64, 1e-10); a file made
for something else, or damaged, is refused by one PlanFileError that names the first
difference, before any rank starts (``distgraph run --plan``) or any search runs
(``Engine(plan=...)``).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import distgraph as dg
from distgraph.plan.file import encode, read

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts"))

import plan_file_training as T  # noqa: E402
import plans as P  # noqa: E402

SCRIPT = Path(__file__).parent / "mpi_scripts" / "plan_file_training.py"
ROOT = Path(__file__).resolve().parents[1]


def env() -> dict:
    """This environment as it is now (a test's job_trace marker included), one BLAS
    thread."""
    return dict(os.environ, OMP_NUM_THREADS="1")


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "distgraph.cli", *map(str, args)], env=env(),
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def specs():
    return dg.app.data.DataLoader(P.Dataset("gpt"), P.BATCH).specs(1)


def saved_plan(kind, path, cluster=None):
    """Plan tests/plans.py's GPT as ``kind`` ("semi" or "full") on ``cluster`` (default:
    Cluster.local(4)) and save it to ``path``; returns the plan."""
    engine = T.engine_of(kind, cluster or dg.Cluster.local(4))
    plan = engine.prepare(*specs())
    plan.save(path)
    return plan


def loading_engine(path, layers=None, strategy=None):
    """An Engine of tests/plans.py's GPT (``layers`` blocks) that plans from ``path``."""
    model = P.build_model("gpt", seed=0, dims=None if layers is None else
                          {**P.GPT_DIMS, "n_layer": layers})
    return dg.Engine(model, P.loss_fn("gpt"), P.make_optimizer("adamw"), plan=path,
                     strategy=strategy)


@pytest.fixture
def no_search(monkeypatch):
    """Fails the test where the automatic search is called."""
    import distgraph.passes.search as search

    def refused(*args, **kwargs):
        raise AssertionError("the search ran")

    monkeypatch.setattr(search, "choose", refused)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{kind: (saved plan, path)} of the searched pipeline plan and the semi plan,
    float64, on Cluster.local(4)."""
    folder = tmp_path_factory.mktemp("plans")
    before = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        return {kind: (saved_plan(kind, folder / f"{kind}.json"), folder / f"{kind}.json")
                for kind in ("full", "semi")}
    finally:
        dg.set_default_dtype(before)


def _same_plan(a, b) -> None:
    assert a.estimate.step_time == b.estimate.step_time
    assert [p.peak_memory for p in a.estimate.processes] == \
        [p.peak_memory for p in b.estimate.processes]
    assert a.stages == b.stages and a.micro_batches == b.micro_batches
    assert a.program.pretty() == b.program.pretty()
    assert a.schedule() == b.schedule() and a.ranks == b.ranks
    assert a.strategy == b.strategy


def _said_file(out: str, path) -> str:
    """The one line in which rank 0 says which plan file it runs."""
    lines = [ln for ln in out.splitlines() if ln.startswith("distgraph: running the plan")]
    assert len(lines) == 1, out[-3000:]
    assert lines[0].startswith(f"distgraph: running the plan in {path} (")
    assert lines[0].endswith("): read from the file, nothing searched")
    return lines[0]


@pytest.mark.parametrize("kind", ["full", "semi"])
def test_a_loaded_plan_is_the_saved_one(files, kind, float64, no_search, tmp_path, capsys):
    saved, path = files[kind]
    engine = loading_engine(path)
    assert engine.plan_file == str(path)
    loaded = engine.prepare(*specs())
    said = _said_file(capsys.readouterr().out, path)
    assert f"{len(saved.stages)} stage" in said and f"{saved.micro_batches} micro" in said
    _same_plan(saved, loaded)
    assert loaded.search is None            # made from the file: no search ran
    assert encode(loaded) == encode(saved)  # and it saves the same file again
    if kind == "full":
        assert saved.search is not None and len(saved.stages) > 1 and saved.micro_batches == 4


def test_the_file_holds_decisions_not_processes(files):
    """Meshes and specs written once each, processes as ranges: the searched plan's file
    holds no list of process ids, and every layout refers to the tables."""
    saved, path = files["full"]
    data = json.loads(Path(path).read_text())
    assert data["format"] == "distgraph-plan" and data["version"] == 1
    assert all("first" in m for m in data["meshes"])
    assert data["decisions"]["rank_mapping"] == [[0, 0, 4]]     # one run: p on device p
    assert len(data["specs"]) < len(data["decisions"]["values"])
    # the recomputation the search chose (the strategy left it unset), not "unset"
    assert saved.strategy.recompute is not None
    # and the ZeRO sharding and sequence parallelism it chose, True or False
    assert isinstance(saved.strategy.sharding, bool)
    assert isinstance(saved.strategy.sequence_parallel, bool)
    assert read(path).strategy == dg.Strategy(
        auto_mode="full", pipeline=True, micro_batches=4, recompute=saved.strategy.recompute,
        sharding=saved.strategy.sharding, sequence_parallel=saved.strategy.sequence_parallel)
    # the result's memory in one unit, bytes: the largest peak, what its device may hold
    # (a CPU of Cluster.local: all of its memory) and the device's memory
    top = max(saved.estimate.processes, key=lambda p: p.peak_memory)
    memory = saved.cluster.device(top.device).memory * 1e9
    assert (data["result"]["peak_memory"], data["result"]["usable_memory"],
            data["result"]["device_memory"]) == (top.peak_memory, memory, memory)
    assert saved.to_dict()["memory"] == {"process": top.process, "peak": top.peak_memory,
                                         "usable": memory, "device": memory}


def test_a_plan_pickles_whole(files, float64, tmp_path):
    for saved, path in files.values():
        copy = pickle.loads(pickle.dumps(saved))
        _same_plan(saved, copy)
        assert copy.to_dict() == saved.to_dict()
        assert sorted(copy.programs) == sorted(saved.programs)
        copy.save(tmp_path / "again.json")
        assert read(tmp_path / "again.json").decisions == read(path).decisions


# -- refused before any rank starts: distgraph run --plan --------------------------------
def _edited(files, tmp_path, kind, edit) -> Path:
    data = json.loads(Path(files[kind][1]).read_text())
    edit(data)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(data))
    return out


def _refused_at_launch(path, tmp_path, trace, *options, n=4, layers=(), kind="semi"):
    """The one line of ``distgraph run --plan path``, refused before any rank started;
    ``trace``: the test's job_trace, which finds no MPI and nothing left of the job."""
    proc = cli("run", "-n", n, *options, "--plan", path, SCRIPT, kind, tmp_path, *layers)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not list(tmp_path.glob("rank-started.*")), "a rank started"
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr                 # one line, no traceback
    assert "Traceback" not in proc.stderr
    trace.assert_nothing_left(ran_mpi=False)
    return lines[0]


def _version(data):
    data["version"] = 2
    data["distgraph"] = "9.0"


def _out_of_range(data):
    data["meshes"][0]["first"] = 7


def _unknown_dim(data):
    spec = next(s for s in data["specs"] if any(isinstance(e, str) for e in s[0]))
    spec[0] = ["z" if isinstance(e, str) else e for e in spec[0]]


def _spec_number(data):
    data["decisions"]["values"][0][2] = len(data["specs"]) + 3


@pytest.mark.parametrize("edit, said", [
    (_version, "format version 2 was written by a newer distgraph (9.0)"),
    (_out_of_range, "process 7 is out of range: the plan has 4 processes (0..3)"),
    (_unknown_dim, "names mesh dim 'z', but its mesh"),
    (_spec_number, "is out of range (the file has"),
])
def test_a_damaged_file_is_refused_before_any_rank_starts(files, tmp_path, edit, said,
                                                          job_trace):
    line = _refused_at_launch(_edited(files, tmp_path, "semi", edit), tmp_path, job_trace)
    assert said in line and "edited.json" in line


def test_a_file_cut_short_is_refused_before_any_rank_starts(files, tmp_path, job_trace):
    text = Path(files["semi"][1]).read_text()
    cut = tmp_path / "cut.json"
    cut.write_text(text[:len(text) // 2])
    line = _refused_at_launch(cut, tmp_path, job_trace)
    assert "cut.json" in line and "it was cut short" in line


def test_a_file_for_another_world_size_is_refused_before_any_rank_starts(files, tmp_path,
                                                                         job_trace):
    line = _refused_at_launch(files["semi"][1], tmp_path, job_trace, n=2)
    assert "the plan was made for 4 processes; the job has 2" in line


def test_a_file_for_another_cluster_is_refused_before_any_rank_starts(files, tmp_path,
                                                                      job_trace):
    line = _refused_at_launch(files["semi"][1], tmp_path, job_trace, "--cluster",
                              ROOT / "resources" / "clusters" / "gpu_2x8.yaml")
    assert "the plan was made for 4 devices" in line and "the cluster has 16" in line


def test_a_file_for_another_program_is_refused_before_any_rank_starts(files, tmp_path,
                                                                      job_trace):
    """The script runs once, as one process, up to its Engine's training program, which
    is checked against the file: a GPT of 3 blocks for a plan of 2."""
    line = _refused_at_launch(files["semi"][1], tmp_path, job_trace, layers=(3,))
    assert "the plan was made for 2 layers; the model has 3" in line


def _three_entries(data):
    """A 2-D weight's spec given three entries."""
    row = next(r for r in data["decisions"]["values"] if r[0] == "blocks.0.mlp.fc1.weight")
    data["specs"].append([[None, None, "mp"], []])
    row[2] = len(data["specs"]) - 1


def _device_4(data):
    data["decisions"]["rank_mapping"] = [[0, 0, 1], [1, 2, 1], [2, 1, 1], [3, 4, 1]]


def _zero_y(data):
    data["decisions"]["zero_dim"] = "y"


def _zero_params(data):
    data["decisions"]["zero_params"] = ["blocks.0.mlp.fc1.weight"]


def _step_time(data):
    data["result"]["step_time"] *= 0.5


def _peak_memory(data):
    data["result"]["peak_memory"] = 1


def _refused_operand(data):
    """The first qkv matmul (op #4) consumes its weight split over the contracted dim."""
    op = next(o for o in data["decisions"]["ops"] if o[0] == 4)
    data["specs"].append([["x", None], []])
    op[2][1] = [op[2][1][0], len(data["specs"]) - 1]


@pytest.mark.parametrize("kind, edit, said", [
    ("semi", _three_entries, "input 1 spec [None, None, mp] has 3 dims, the notation gives "
                             "it 2"),
    ("semi", _device_4, "the rank mapping uses devices [4], but this job's 4 ranks own "
                        "devices [0, 1, 2, 3]"),
    ("semi", _zero_y, "decisions.zero_dim: 'y' is no mesh dim of the plan (its meshes have "
                      "dims dp, mp)"),
    ("semi", _zero_params, "decisions.zero_params: only a searched plan's decisions"),
    ("semi", _step_time, "result.step_time is 0.00"),
    ("semi", _peak_memory, "result.peak_memory is 1, but its decisions make a plan of "
                           "peak_memory"),
    ("full", _refused_operand, "op #4 matmul (blocks.0.attn.qkv) consumes "
                               "'blocks.0.attn.qkv.weight' as [x, None] in the file, but its "
                               "rules make it [None, None]"),
])
def test_a_file_edited_into_a_plan_that_cannot_run_is_refused_before_any_rank_starts(
        files, tmp_path, kind, edit, said, job_trace):
    """The plan is made from the file once before the ranks start (no rank's program
    compiled): what every rank would refuse after planning is refused there, in one line."""
    line = _refused_at_launch(_edited(files, tmp_path, kind, edit), tmp_path, job_trace,
                              kind=kind)
    assert said in line and "edited.json" in line, line


def _sharding(data):
    data["strategy"]["sharding"] = True


def test_a_strategy_edited_in_the_file_is_said(files, tmp_path, float64, no_search, job_trace):
    """sharding=True written into a file saved without it: an Engine that takes the
    file's Strategy makes another plan than the file's result says; one whose script
    sets sharding=False is refused before any rank starts."""
    path = _edited(files, tmp_path, "semi", _sharding)
    with pytest.raises(dg.PlanFileError, match="result.step_time is .*, but its decisions "
                                               "make a plan of step_time .*: the file was "
                                               "edited"):
        loading_engine(path).prepare(*specs())
    line = _refused_at_launch(path, tmp_path, job_trace)
    assert "the Engine's Strategy(sharding=False) is not the plan file's (sharding=True" in line


# -- refused before any search: Engine(plan=...) -----------------------------------------
def test_a_file_for_another_program_is_refused_before_any_search(files, float64, no_search):
    engine = loading_engine(files["full"][1], layers=3)
    with pytest.raises(dg.PlanFileError, match="the plan was made for 2 layers; the model "
                                               "has 3"):
        engine.prepare(*specs())


def test_a_strategy_other_than_the_files_is_refused_and_one_left_to_the_search_is_not(
        files, float64, no_search):
    """The Engine's Strategy sets micro_batches=2 for a file of 4: refused, naming both;
    the script's own Strategy (recompute left to the search, the file holding its
    choice) plans from the file, and its runtime-only options are kept."""
    path = files["full"][1]
    with pytest.raises(dg.DistGraphError, match=r"Strategy\(micro_batches=2\) is not the plan "
                                                r"file's \(micro_batches=4"):
        loading_engine(path, strategy=dg.Strategy(auto_mode="full", pipeline=True,
                                                  micro_batches=2))
    engine = loading_engine(path, strategy=dg.Strategy(auto_mode="full", pipeline=True,
                                                       micro_batches=4, memory_check=True))
    assert engine.strategy.recompute == files["full"][0].strategy.recompute is not None
    assert engine.strategy.memory_check and engine.prepare(*specs()).micro_batches == 4


def test_a_file_for_another_batch_is_refused_before_any_search(files, float64, no_search):
    engine = loading_engine(files["semi"][1])
    ins, labels = dg.app.data.DataLoader(P.Dataset("gpt"), 4).specs(1)
    with pytest.raises(dg.PlanFileError, match=r"input 'input_0' of shape \[8, 8\] int64; "
                                               r"the program's is \[4, 8\] int64"):
        engine.prepare(ins, labels)


def test_a_file_for_another_world_size_is_refused_in_a_job(files):
    """In a job of 2 ranks (as under mpiexec -n 2) the Engine refuses a 4-process file
    when it is made."""
    code = ("import distgraph as dg, sys; sys.path[:0] = [%r, %r]; import plans as P\n"
            "try:\n    dg.Engine(P.build_model('gpt'), plan=%r)\n"
            "except dg.PlanFileError as e:\n    print('REFUSED', e)\n"
            % (str(ROOT / "tests"), str(ROOT / "tests" / "mpi_scripts"),
               str(files["semi"][1])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(env(), PMI_SIZE="2", PMI_RANK="1"), timeout=120)
    assert "REFUSED" in proc.stdout, proc.stdout + proc.stderr
    assert "the plan was made for 4 processes; the job has 2" in proc.stdout


def _op_out_of_range(data):
    data["decisions"]["ops"][0][0] = 10 ** 6


def _refused_layout(data):
    """The first layer norm's result declared a pending sum (P(x)): its rule makes none."""
    values = data["decisions"]["values"]
    row = next(row for row in values if row[0] == "layer_norm_0")
    ndim = len(data["specs"][row[2]][0])
    data["specs"].append([[None] * ndim, ["x"]])
    row[2] = len(data["specs"]) - 1


@pytest.mark.parametrize("edit, said", [
    (_op_out_of_range, "op #1000000 is out of range: the program has"),
    (_refused_layout, "value 'layer_norm_0' is laid out as [None, None, None] P(x)"),
])
def test_a_file_edited_against_the_program_is_refused_before_any_search(
        files, tmp_path, float64, no_search, edit, said):
    engine = loading_engine(_edited(files, tmp_path, "full", edit))
    with pytest.raises(dg.PlanFileError, match="edited.json") as err:
        engine.prepare(*specs())
    assert said in str(err.value)


# -- trained on real ranks ---------------------------------------------------------------
def _result(proc, tag="PLANFILE-RESULT"):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(tag + " ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["full", "semi"])
def test_a_saved_plan_trains_on_four_ranks_as_serially(kind, float64, tmp_path, job_trace):
    """Saved in one process (the searched plan through the API, the semi plan through
    ``distgraph plan --save``), loaded by 4 MPI ranks under ``distgraph run --plan``:
    the same plan (estimate, stages, micro-batches, program), no search, and training
    equal to serial training."""
    path = tmp_path / "plan.json"
    if kind == "full":
        saved = saved_plan("full", path)
    else:
        proc = cli("plan", SCRIPT, "-n", 4, "--save", path, "--", "semi", tmp_path)
        assert proc.returncode == 0 and "wrote plan file" in proc.stdout, proc.stderr
        saved = saved_plan("semi", tmp_path / "again.json")     # the same plan, here
        assert read(path).decisions == read(tmp_path / "again.json").decisions
    proc = cli("run", "-n", 4, "--plan", path, SCRIPT, kind, tmp_path, timeout=600)
    got = _result(proc)
    _said_file(proc.stdout, path)                   # once: rank 0 says it
    assert got["world"] == 4 and not got["searched"] and not got["search_imported"]
    assert got["step_time"] == saved.estimate.step_time
    assert got["stages"] == [str(m) for m in saved.stages]
    assert got["micro_batches"] == saved.micro_batches
    assert got["program"] == hashlib.sha256(saved.program.pretty().encode()).hexdigest()
    losses, params = P.serial_reference("gpt")
    params_got = dict(np.load(tmp_path / "params.npz"))
    err = P.compare((got["losses"], params_got), (losses, params), "float64")
    assert err["steps"] == P.STEPS
    assert err["loss"] < P.TOLERANCE["float64"] and err["param"] < P.TOLERANCE["float64"], err
    job_trace.assert_nothing_left(ran_mpi=True)
