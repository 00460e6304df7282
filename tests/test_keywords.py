"""A mistyped keyword (issue 67): ``Strategy``, ``Engine``, ``Cluster`` and the config of
``parallelize`` name the nearest one that exists, and ``distgraph run``'s one line shows
the file and line of the user's script where the call is."""

import re
import sys
from pathlib import Path

import pytest

import distgraph as dg
from distgraph.keywords import KeywordError, keywords_checked

sys.path.insert(0, str(Path(__file__).parent))
from user_scripts import run_user, with_prelude  # noqa: E402


@pytest.mark.parametrize("call, said", [
    (lambda: dg.Strategy(auto_mod="full"),
     "Strategy(auto_mod=...): no such keyword (did you mean 'auto_mode'?)"),
    (lambda: dg.Strategy(micro_batch=4),
     "Strategy(micro_batch=...): no such keyword (did you mean 'micro_batches'?)"),
    (lambda: dg.Engine(dg.nn.MLP(4, 4, 4), optimiser=dg.optim.SGD(0.1)),
     "Engine(optimiser=...): no such keyword (did you mean 'optimizer'?)"),
    (lambda: dg.Cluster.local(4, devices="CPU"),
     "Cluster.local(devices=...): no such keyword (did you mean 'device'?)"),
    (lambda: dg.Cluster(machine=()),
     "Cluster(machine=...): no such keyword (did you mean 'machines'?)"),
], ids=["strategy", "strategy-plural", "engine", "cluster-local", "cluster"])
def test_a_mistyped_keyword_names_the_nearest(call, said):
    with pytest.raises(KeywordError) as err:
        call()
    assert str(err.value) == said
    # still what Python raises for a wrong keyword, and a distgraph error
    assert isinstance(err.value, TypeError) and isinstance(err.value, dg.DistGraphError)


def test_a_keyword_far_from_every_one_lists_them_all():
    with pytest.raises(KeywordError, match=r"Strategy\(colour=\.\.\.\): no such keyword; it "
                                           r"takes auto_mode, pipeline, schedule, "):
        dg.Strategy(colour="red")


def test_good_keywords_and_positional_arguments_pass_through():
    assert dg.Strategy(auto_mode="full", micro_batches=2).micro_batches == 2
    assert len(dg.Cluster.local(2, "CPU").devices) == 2

    @keywords_checked
    def f(a, *, b=1, **rest):        # takes any keyword: nothing to check
        return a, b, rest

    assert f(1, c=3) == (1, 1, {"c": 3})


@pytest.mark.parametrize("config, said", [
    ({"mp_confg": {"parallelize_plan": "megatron"}},
     "config key 'mp_confg' is not one it knows (did you mean 'mp_config'?)"),
    ({"mp_config": {"parallelise_plan": "megatron"}},
     "config['mp_config'] key 'parallelise_plan' is not one it knows (did you mean "
     "'parallelize_plan'?)"),
])
def test_a_mistyped_key_of_parallelizes_config_names_the_nearest(config, said):
    mesh = dg.ProcessMesh([0, 1], ["mp"])
    with pytest.raises(dg.DistGraphError) as err:
        dg.parallelize(dg.nn.GPT(32, 16, 1, 2, 8), mesh, config)
    assert said in str(err.value)


@pytest.mark.mpi
def test_distgraph_runs_one_line_shows_the_scripts_file_and_line(tmp_path):
    script = with_prelude("""
        engine = mlp_engine(strategy=dg.Strategy(auto_mod="full"))
    """)
    line = script.splitlines().index('engine = mlp_engine(strategy=dg.Strategy(auto_mod="full"))')
    rc, out = run_user(tmp_path, script, 2)
    assert rc != 0
    failed = [ln for ln in out.splitlines() if " failed: " in ln]
    assert len(failed) == 1, out
    assert re.fullmatch(r"distgraph: ranks? (0, 1|0|1) failed: KeywordError: "
                        r"Strategy\(auto_mod=\.\.\.\): no such keyword \(did you mean "
                        r"'auto_mode'\?\) \((.*):(\d+)\)", failed[0]), out
    where = re.search(r"\((\S+):(\d+)\)$", failed[0])
    assert Path(where[1]) == (tmp_path / "user_script.py").resolve()
    assert int(where[2]) == line + 1
