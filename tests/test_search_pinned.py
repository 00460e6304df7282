"""The run DP's and the recursive search's answers on a fixed corpus are those pinned in
tests/data/search_outputs.json: the same stages, options, objectives, caps solved,
choices, peaks, notes and layouts, floats to the last bit (tests/pin_search_outputs.py
says what the corpus is and how each answer is recorded). The file was written from the
code as it stood while the old versions once kept as oracles (the run DP before it was
vectorised, the recursive search before it was made cheaper) still agreed with it on the
cases they were compared on. A change of plans that is meant re-pins it (``python
tests/pin_search_outputs.py``, its diff reviewed); one that is not fails here, naming
the entry and the field that moved."""

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from distgraph.passes.search.stages.run_dp import beats  # noqa: E402

import pin_search_outputs as pin  # noqa: E402

PINNED = pin.load()
CORPUS = pin.corpus()


def differences(found, kept, at="") -> list:
    """The paths (``stages/2/time``) where ``found`` and ``kept`` differ."""
    if isinstance(found, dict) and isinstance(kept, dict):
        return [p for k in dict.fromkeys([*found, *kept])
                for p in (differences(found[k], kept[k], f"{at}/{k}") if k in found and k in kept
                          else [f"{at}/{k} ({'new' if k in found else 'gone'})"])]
    if isinstance(found, list) and isinstance(kept, list) and len(found) == len(kept):
        return [p for k, (a, b) in enumerate(zip(found, kept))
                for p in differences(a, b, f"{at}/{k}")]
    return [] if found == kept else [f"{at or '/'}: {kept!r} pinned, {found!r} now"]


def test_the_corpus_is_the_one_pinned():
    assert list(CORPUS) == list(PINNED)


@pytest.mark.parametrize("name", [n for n in CORPUS if n.startswith("run_dp/")])
def test_the_run_dp_plans_the_pinned_stages(name):
    assert not differences(CORPUS[name](), PINNED[name])[:10]


@pytest.mark.parametrize("seed", range(12))
def test_beats_says_whether_the_pinned_plan_lies_below_a_latency(seed):
    """``beats`` (the same search, its caps pruned by the latency) finds a plan below
    just above the pinned objective, none below it, and none where the DP refused."""
    args = pin.run_dp_random_case(seed)
    options, count, blocks, cluster, B = args
    for fit in (True, False):
        kept = PINNED[f"run_dp/random/{seed}/{'fit' if fit else 'unlimited'}"]
        if "refused" in kept:
            assert not beats(math.inf, count, blocks, options, cluster, B, fit)
            continue
        objective = float(kept["objective"])
        assert beats(objective * (1 + 1e-9), count, blocks, options, cluster, B, fit)
        assert not beats(objective, count, blocks, options, cluster, B, fit)


@pytest.mark.parametrize("name", [n for n in CORPUS if n.startswith("recursive/random/")])
def test_the_recursive_search_answers_random_problems_as_pinned(name):
    assert not differences(CORPUS[name](), PINNED[name])[:10]


@pytest.mark.slow                           # six GPT plans: about 10 s in all
@pytest.mark.parametrize("name", [n for n in CORPUS if n.startswith("recursive/gpt/")])
def test_the_recursive_search_plans_a_gpt_as_pinned(name):
    assert not differences(CORPUS[name](), PINNED[name])[:10]
