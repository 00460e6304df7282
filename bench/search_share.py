"""Where a searched plan's CPU seconds go, per ``Strategy.search``: the parts of the
intra-op searches against the rest of planning, on one Megatron Table 1 row.

For each search (``--search auto,ilp``) it plans the row as ``bench/megatron_table1.py``
does and prints the CPU seconds of planning in all and of its parts, timed where they
are called (each wrapped for the run, its behaviour unchanged; nested parts are
included in their callers): the intra-op searches (``intra_op.search``, and
``intra_op.price`` of a choice moved to another mesh), their spaces
(``SearchSpace.__post_init__``), problems (``intra_op._problem``) and, of those, the
reshard matrices of the edges (``LayoutPrices.matrix``), the recursive search
(``solve_recursive``) and SCIP (``ilp.solve``). Then, with two searches, the first's
planning time as a ratio to the second's, and the ratio it would reach if its problems
and its recursive search cost nothing (the most a cheaper problem or search can give:
what is left is planning the two share), and the ratio it would reach if all planning
outside the intra-op searches and their pricing cost nothing.

Run::

    nice python bench/search_share.py [--row 145.6B] [--search auto,ilp]
"""

from __future__ import annotations

import argparse
import contextlib
import time

import distgraph as dg
import distgraph.passes.search as front
from distgraph.passes.cost import layout_prices
from distgraph.passes.search.layouts import intra_op, space
from distgraph.passes.search.stages import pipeline, runs
from gpt_scale import dgx_cluster, gpt, program
from megatron_table1 import TABLE1

# (name, the modules or classes whose attribute is called, the attribute): a function
# imported by name is wrapped where each caller looks it up
PARTS = (("searches", (runs, front, pipeline), "search"), ("pricing moved choices", (runs,), "price"),
         ("spaces", (space.SearchSpace,), "__post_init__"),
         ("problems", (intra_op,), "_problem"),
         ("  reshard matrices", (layout_prices.LayoutPrices,), "matrix"),
         ("recursive search", (intra_op,), "solve_recursive"), ("SCIP", (intra_op,), "solve"))


@contextlib.contextmanager
def timed_parts(seconds: dict):
    """Within the block, ``seconds[name]`` sums the CPU seconds of each part of PARTS."""
    saved = []
    for name, owners, attr in PARTS:
        for owner in owners:
            fn = getattr(owner, attr)
            saved.append((owner, attr, fn))

            def wrapped(*args, _fn=fn, _name=name, **kwargs):
                start = time.process_time()
                try:
                    return _fn(*args, **kwargs)
                finally:
                    seconds[_name] = seconds.get(_name, 0.0) + time.process_time() - start
            setattr(owner, attr, wrapped)
    try:
        yield seconds
    finally:
        for owner, attr, fn in saved:
            setattr(owner, attr, fn)


def plan_row(row, method: str) -> dict:
    """CPU seconds of planning ``row`` with ``Strategy(search=method)``, and of its parts."""
    cluster = dgx_cluster(row.gpus // 8)
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=row.micro_batches,
                           recompute=True, search=method)
    built = program(gpt(row.layers, row.hidden, row.heads), row.batch)
    seconds: dict = {}
    with timed_parts(seconds):
        start = time.process_time()
        dg.passes.plan(built, strategy, cluster, ranks=())
        seconds["planning"] = time.process_time() - start
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--row", default="145.6B")
    parser.add_argument("--search", default="auto,ilp")
    args = parser.parse_args()
    rows = {r.name: r for r in TABLE1}
    if args.row not in rows:
        parser.error(f"no row {args.row!r}; rows: {', '.join(rows)}")
    row = rows[args.row]
    methods = args.search.split(",")
    bad = sorted(set(methods) - set(dg.strategy.SEARCHES))
    if bad:
        parser.error(f"no search {bad}; searches: {', '.join(dg.strategy.SEARCHES)}")
    found = {m: plan_row(row, m) for m in methods}
    names = ["planning"] + [name for name, _, _ in PARTS]
    print(f"{row.name} on {row.gpus} GPUs: CPU seconds   " +
          "  ".join(f"{m:>8}" for m in methods))
    for name in names:
        print(f"  {name:28}" + "  ".join(f"{found[m].get(name, 0.0):8.2f}" for m in methods))
    if len(methods) > 1:
        first, second = found[methods[0]], found[methods[1]]
        floor = first["planning"] - first.get("problems", 0.0) - \
            first.get("recursive search", 0.0)
        print(f"  {methods[0]} planned {second['planning'] / first['planning']:.2f} x faster "
              f"than {methods[1]}; at most {second['planning'] / floor:.2f} x with its "
              "problems and recursive search free")
        own = {m: found[m].get("searches", 0.0) + found[m].get("pricing moved choices", 0.0)
               for m in methods}
        shared = first["planning"] - own[methods[0]]
        print(f"  the intra-op searches and pricing: {own[methods[0]]:.2f} s and "
              f"{own[methods[1]]:.2f} s; the rest of planning ({shared:.2f} s) both share. "
              f"With it free, at most {own[methods[1]] / own[methods[0]]:.2f} x; 5 x needs "
              f"{methods[0]}'s searches and pricing <= {own[methods[1]] / 5:.2f} s")


if __name__ == "__main__":
    main()
