"""The sharding ILP (passes/ilp.py) against brute force.

Oracle: every choice of every node enumerated, each checked and costed by the code in
this file (written from the contract, not from the solver): objective = node costs + edge
matrices, aliases forbid, follow/share tie, liveness sets bound memory.
"""

import dataclasses
import itertools
import math
import re

import numpy as np
import pytest

from distgraph.errors import PlanError
from distgraph.passes.search.layouts.ilp import (ShardingProblem, evaluate, peak_bound, peak_memory,
                                         reduce_problem, solve, unique_rows)


def random_problem(seed, budget_kind="random"):
    """A small random problem using every feature: inf costs, edges (some with inf
    entries, some separable), aliases, follow chains, share classes, liveness."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 7))
    counts = [int(rng.integers(1, 5)) for _ in range(n)]
    compute = [rng.integers(0, 10, k).astype(float) for k in counts]
    comm = [rng.integers(0, 5, k).astype(float) for k in counts]
    memory = [rng.integers(0, 8, k).astype(float) for k in counts]
    for v in range(n):
        if counts[v] > 1 and rng.random() < 0.15:
            compute[v][rng.integers(counts[v])] = math.inf
    follow = [-1] * n
    for i in range(1, n):
        leaders = [j for j in range(i) if counts[j] == counts[i]]
        if leaders and rng.random() < 0.25:
            follow[i] = int(rng.choice(leaders))
    share = []
    free = [v for v in range(n) if follow[v] == -1]
    if rng.random() < 0.4:
        by_count = {}
        for v in free:
            by_count.setdefault(counts[v], []).append(v)
        groups = [g for g in by_count.values() if len(g) >= 2]
        if groups:
            share.append(groups[0][:int(rng.integers(2, len(groups[0]) + 1))])
    edges, aliases = [], []
    pairs = [(u, v) for u in range(n) for v in range(n) if u != v]
    for k in rng.choice(len(pairs), size=min(len(pairs), int(rng.integers(0, 2 * n))),
                        replace=False):
        u, v = pairs[k]
        kind = rng.random()
        if kind < 0.2:      # separable: a[i] + b[j]
            mat = rng.integers(0, 5, (counts[u], 1)) + rng.integers(0, 5, (1, counts[v]))
            mat = mat.astype(float)
        else:
            mat = rng.integers(0, 12, (counts[u], counts[v])).astype(float)
            if kind > 0.9:
                mat[rng.integers(counts[u]), rng.integers(counts[v])] = math.inf
        edges.append((u, v, mat))
    for _ in range(int(rng.integers(0, 3))):
        u, v = pairs[int(rng.integers(len(pairs)))]
        forbid = (rng.random((counts[u], counts[v])) < 0.35).astype(int)
        aliases.append((u, v, forbid))
    liveness = []
    for _ in range(int(rng.integers(0, 5))):
        size = int(rng.integers(1, n + 1))
        liveness.append(sorted(rng.choice(n, size=size, replace=False).tolist()))
    budget = None
    if liveness and budget_kind == "random":
        budget = float(rng.integers(0, 25)) if rng.random() < 0.6 else None
    elif liveness and budget_kind == "tight":
        budget = 0.0
    return ShardingProblem(counts, compute, comm, memory, edges=edges, aliases=aliases,
                           follow=follow, liveness=liveness, memory_budget=budget, share=share)


def oracle(p):
    """(best objective, smallest peak) over the choices that satisfy everything except the
    budget, and the best objective within the budget; inf where nothing qualifies."""
    best, best_in_budget, smallest_peak = math.inf, math.inf, math.inf
    for c in itertools.product(*[range(k) for k in p.strategy_counts]):
        if any(j != -1 and c[i] != c[j] for i, j in enumerate(p.follow)):
            continue
        if any(c[v] != c[g[0]] for g in p.share for v in g):
            continue
        if any(V[c[u]][c[v]] for u, v, V in p.aliases):
            continue
        cost = max([sum(p.compute[v][c[v]] + p.comm[v][c[v]] for v in range(p.n))] +
                   [sum(rows[v][c[v]] for v in range(p.n)) for rows in p.other_processes])
        cost += sum(R[c[u]][c[v]] for u, v, R in p.edges)
        if math.isinf(cost):
            continue
        peak = max((sum(p.memory[v][c[v]] for v in live) for live in p.liveness), default=0)
        best = min(best, cost)
        smallest_peak = min(smallest_peak, peak)
        if p.memory_budget is None or peak <= p.memory_budget:
            best_in_budget = min(best_in_budget, cost)
    return best, best_in_budget, smallest_peak


def check_against_oracle(p):
    best, best_in_budget, smallest_peak = oracle(p)
    if math.isinf(best):
        with pytest.raises(PlanError, match=r"no allowed (choice|strategy)|forbid every pair"):
            solve(p, time_limit=30)
        return "conflict"
    if math.isinf(best_in_budget):
        with pytest.raises(PlanError, match=re.escape("smallest peak memory any choice "
                                                      f"reaches is {smallest_peak:g};")):
            solve(p, time_limit=30)
        return "over budget"
    sol = solve(p, time_limit=30)
    assert sol.status == "optimal" and sol.gap == 0
    assert sol.objective == pytest.approx(best_in_budget, abs=1e-9)
    assert evaluate(p, sol.choice) == pytest.approx(best_in_budget, abs=1e-9)
    assert sol.peak_memory == peak_memory(p, sol.choice)
    if p.memory_budget is not None:
        assert sol.peak_memory <= p.memory_budget + 1e-9
    return "solved"


def test_the_public_contract_path_is_the_solver():
    """DESIGN.md's public contract names ``from distgraph.passes.ilp import
    ShardingProblem, solve``: that path stays, and is the solver tested here."""
    from distgraph.passes import ilp
    assert ilp.ShardingProblem is ShardingProblem and ilp.solve is solve


@pytest.mark.parametrize("seed", range(120))
def test_random_problems_match_brute_force(seed):
    check_against_oracle(random_problem(seed))


def unlike_processes(seed):
    """random_problem(seed) whose mesh holds one or two further kinds of process, each
    paying its own seconds per strategy (some slower, some faster, an inf now and then)."""
    p = random_problem(seed)
    rng = np.random.default_rng(seed + 1000)
    kinds = []
    for _ in range(int(rng.integers(1, 3))):
        rows = [np.where(rng.random(k) < 0.1, math.inf, rng.integers(0, 14, k).astype(float))
                for k in p.strategy_counts]
        kinds.append(rows)
    return dataclasses.replace(p, other_processes=kinds)


@pytest.mark.parametrize("seed", range(80))
def test_the_slowest_kind_of_process_is_the_objective_as_brute_force_finds_it(seed):
    """Oracle: each choice's objective is its edges plus the largest of the kinds' node
    sums (the step waits for the slowest process)."""
    check_against_oracle(unlike_processes(seed))


def bytes_problem(seed):
    """A chain of ops priced as the searches price them: seconds of 1e-4 .. 0.1, memory in
    bytes (0.25 .. 8 GiB), liveness windows of three, a budget between the smallest peak
    and twice it."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 7))
    counts = [int(rng.integers(2, 4)) for _ in range(n)]
    compute = [rng.uniform(1e-4, 0.1, k) * (rng.random(k) < 0.8) for k in counts]
    memory = [rng.choice([2.0 ** 28, 2.0 ** 30, 2.0 ** 31, 3 * 2.0 ** 30, 2.0 ** 33], k)
              for k in counts]
    edges = [(v, v + 1, rng.uniform(0, 0.01, (counts[v], counts[v + 1]))) for v in range(n - 1)]
    liveness = [list(range(i, min(n, i + 3))) for i in range(n)]
    p = ShardingProblem(counts, compute, [np.zeros(k) for k in counts], memory, edges=edges,
                        liveness=liveness)
    return p.with_budget(oracle(p)[2] * rng.uniform(1.0, 2.0))


@pytest.mark.parametrize("seed", range(60))
def test_memory_in_bytes_matches_brute_force(seed):
    """The solver's memory rows must not lose choices that fit to the size of the numbers:
    in bytes, SCIP's presolve once called a choice optimal while cheaper ones fit."""
    assert check_against_oracle(bytes_problem(seed)) == "solved"


@pytest.mark.parametrize("seed", range(120))
def test_the_peak_bound_is_below_every_allowed_choice(seed):
    """peak_bound lets the solvers refuse a budget without a model: it must never exceed
    the smallest peak brute force finds (and equals it where every node's least memory
    can be chosen together)."""
    p = random_problem(seed)
    best, _, smallest_peak = oracle(p)
    if math.isinf(best):
        return
    bound = peak_bound(reduce_problem(p))
    assert bound <= smallest_peak + 1e-9
    if not p.follow.count(-1) < p.n and not p.share and not p.aliases and not p.edges and \
            all(np.isfinite(c).all() for c in p.compute):
        assert bound == pytest.approx(smallest_peak)


@pytest.mark.parametrize("seed", range(40))
def test_costs_in_nanoseconds_are_solved_as_exactly_as_in_units(seed):
    """Costs in seconds can be 1e-9 .. 1e-2; SCIP's tolerances are absolute, so unscaled
    such costs let it call a worse choice optimal. The same problems in units of 1e-9
    reach the brute-force optimum in those units."""
    p = random_problem(seed)
    best, best_in_budget, _ = oracle(p)
    if math.isinf(best_in_budget):
        return
    tiny = 1e-9
    q = ShardingProblem(p.strategy_counts, [np.asarray(c) * tiny for c in p.compute],
                        [np.asarray(c) * tiny for c in p.comm], p.memory,
                        edges=[(u, v, np.asarray(R) * tiny) for u, v, R in p.edges],
                        aliases=p.aliases, follow=p.follow, liveness=p.liveness,
                        memory_budget=p.memory_budget, share=p.share)
    sol = solve(q, time_limit=30)
    assert sol.objective == pytest.approx(best_in_budget * tiny, rel=1e-9, abs=1e-18)


def test_random_problems_cover_every_outcome():
    outcomes = {check_against_oracle(random_problem(seed, "tight")) for seed in range(40)}
    assert outcomes == {"conflict", "over budget", "solved"}


def test_issue_example():
    R02 = [[0, 1, 2, 3], [1, 0, 1, 2], [2, 1, 0, 1], [3, 2, 1, 0]]
    V12 = [[0, 1, 1, 1], [1, 0, 1, 1], [1, 1, 0, 1]]
    kw = {"compute": [[4, 2, 2, 1], [1, 1, 1], [1, 2, 3, 4]],
          "comm": [[0] * 4, [0] * 3, [0] * 4], "memory": [[8, 4, 2, 1], [3, 3, 3], [8, 4, 2, 1]],
          "edges": [(0, 2, R02)], "aliases": [(1, 2, V12)], "follow": [-1, -1, 0],
          "liveness": [[0], [0, 1], [1, 2]]}
    # c0 = c2 = i (follow), c1 = i (alias; i = 3 has no partner): cost = 6, 5, 6 and
    # peak memory = 11, 7, 5 for i = 0, 1, 2.
    sol = solve(ShardingProblem([4, 3, 4], **kw, memory_budget=None), time_limit=60)
    assert sol.choice == (1, 1, 1) and sol.objective == 5 and sol.peak_memory == 7
    assert sol.status == "optimal" and sol.gap == 0 and sol.solve_time > 0
    sol = solve(ShardingProblem([4, 3, 4], **kw, memory_budget=6), time_limit=60)
    assert sol.choice == (2, 2, 2) and sol.objective == 6 and sol.peak_memory == 5
    with pytest.raises(PlanError, match="smallest peak memory any choice reaches is 5;"):
        solve(ShardingProblem([4, 3, 4], **kw, memory_budget=4.5), time_limit=60)


def test_share_ties_blocks_and_keeps_boundary_edges():
    """Three identical 'blocks' of two nodes; a boundary edge from each block's second
    node to the next block's first node. Sharing makes every block choose alike; the
    objective equals brute force over tied choices and is >= the unshared one."""
    node_costs = [[1.0, 3.0], [2.0, 0.0]]
    inner, boundary = [[0.0, 4.0], [4.0, 0.0]], [[0, 5], [5, 0]]
    counts, compute, comm, memory, edges = [2] * 6, node_costs * 3, [[0, 0]] * 6, [[0, 0]] * 6, []
    for b in range(3):
        edges.append((2 * b, 2 * b + 1, inner))
        if b:
            edges.append((2 * b - 1, 2 * b, boundary))
    free = ShardingProblem(counts, compute, comm, memory, edges=edges)
    shared = ShardingProblem(counts, compute, comm, memory, edges=edges,
                             share=[[0, 2, 4], [1, 3, 5]])
    s_free, s_shared = solve(free), solve(shared)
    assert s_shared.choice[0::2] == (s_shared.choice[0],) * 3
    assert s_shared.choice[1::2] == (s_shared.choice[1],) * 3
    assert s_free.objective == oracle(free)[0]
    assert s_shared.objective == oracle(shared)[0] >= s_free.objective
    assert s_shared.variables < s_free.variables


def test_separable_edges_need_no_edge_variables():
    # R[i][j] = a[i] + b[j] folds into the node costs: only the one-hot s variables remain.
    a, b = np.array([1.0, 5.0, 2.0]), np.array([0.0, 3.0])
    p = ShardingProblem([3, 2], [[0, 0, 0], [0, 0]], [[0, 0, 0], [0, 0]], [[0, 0, 0], [0, 0]],
                        edges=[(0, 1, a[:, None] + b[None, :])])
    sol = solve(p)
    assert sol.variables == 5 and sol.objective == 1.0 and sol.choice == (0, 0)


def hard_problem(n=45, k=6, seed=0):
    """Dense random edges between every pair: a quadratic assignment-like instance."""
    rng = np.random.default_rng(seed)
    edges = [(u, v, rng.integers(0, 100, (k, k))) for u in range(n) for v in range(u + 1, n)]
    zeros = [[0.0] * k] * n
    return ShardingProblem([k] * n, rng.integers(0, 50, (n, k)), zeros, zeros, edges=edges)


@pytest.mark.slow
def test_time_limit_returns_best_found_with_gap():
    p = hard_problem()
    sol = solve(p, time_limit=2)
    assert sol.status == "time_limit"
    assert sol.gap > 0
    assert sol.objective == evaluate(p, sol.choice) < math.inf


def base(**kw):
    fields = {"strategy_counts": [2, 2], "compute": [[0, 0], [0, 0]],
              "comm": [[0, 0], [0, 0]], "memory": [[0, 0], [0, 0]], "names": ["fc1", "relu"]}
    fields.update(kw)
    return fields


@pytest.mark.parametrize("fields, message", [
    (base(strategy_counts=[2, 0]), r"strategy_counts\[1\] = 0"),
    (base(compute=[[0, 0], [0]]), r"compute\[1\] has 1 entries but node 1 \('relu'\)"),
    (base(comm=[[0, 0]]), "comm has 1 rows for 2 nodes"),
    (base(memory=[[0, -1], [0, 0]]), r"memory\[0\]\[1\] = -1.0 .*finite numbers >= 0"),
    (base(compute=[[0, float("nan")], [0, 0]]), r"compute\[0\]\[1\] = nan"),
    (base(edges=[(0, 1, [[0, 1, 2], [0, 1, 2]])]),
     r"edges\[0\].*shape \(2, 3\); expected \(2, 2\)"),
    (base(edges=[(0, 0, [[0, 1], [0, 1]])]), "joins node 0 .* to itself"),
    (base(edges=[(0, 2, [[0, 1], [0, 1]])]), r"edges\[0\] names node 2; nodes are 0..1"),
    (base(aliases=[(0, 1, [[0, 2], [0, 1]])]), r"V\[0\]\[1\] = 2.0; expected 0"),
    (base(follow=[1, 0]), "follow has a cycle node 0 .* -> node 1 .* -> node 0"),
    (base(follow=[-1]), "follow has 1 entries for 2 nodes"),
    (base(strategy_counts=[2, 3], compute=[[0, 0], [0, 0, 0]], comm=[[0, 0], [0, 0, 0]],
          memory=[[0, 0], [0, 0, 0]], follow=[-1, 0]), "same strategy count"),
    (base(share=[[0, 1], [1]]), r"in share\[0\] and share\[1\]"),
    (base(liveness=[[0, 0]]), r"liveness\[0\] lists node 0 \('fc1'\) twice"),
    (base(liveness=[[0], [1, 2]]), r"liveness\[1\] names node 2; nodes are 0..1"),
    (base(liveness=[[True]]), r"liveness\[0\] names node True"),
    (base(memory_budget=3), "memory_budget is set but liveness is empty"),
    (base(liveness=[[0]], memory_budget=float("inf")), "memory_budget = inf"),
    (base(names=["a"]), "1 names for 2 nodes"),
    (base(liveness=[[0], [1]], memory=[[4, 4], [1, 1]], released=[(0, 0, 1, [1, 1])]),
     r"released\[0\] frees node 0 \('fc1'\) from time 0 to 1, where it is not live"),
    (base(liveness=[[0], [0]], memory=[[4, 4], [1, 1]], released=[(0, 1, 1, [5, 1])]),
     r"released\[0\] frees \[5.0, 1.0\] bytes of node 0 .* 0 <= bytes <= its memory"),
    (base(liveness=[[0], [0, 1]], running=[0, 1],
          copies=[(0, 1, [[0, -1], [0, 0]], [[0, 0], [0, 0]])]),
     r"copies\[0\] has -1.0 at \[0, 1\]; expected bytes"),
    (base(liveness=[[0], [0, 1]], running=[0, 1], copies=[(0, 1, [[0, 1], [1, 0]], [0, 0])]),
     r"copies\[0\] gives \(2, 2\) copy bytes but \(2,\) freed bytes"),
    (base(liveness=[[0], [0, 1]], copies=[(0, 1, [[0, 1], [1, 0]], [[0, 0], [0, 0]])]),
     "copies are held while their reader runs, but running is empty"),
])
def test_invalid_problems_name_the_field(fields, message):
    with pytest.raises(PlanError, match=message):
        ShardingProblem(**fields)


def test_liveness_ids_of_numpy_ints_are_taken_as_ints():
    p = ShardingProblem(**base(liveness=[np.array([0, 1])], memory=[[1, 2], [3, 4]]))
    assert p.liveness == ((0, 1),) and all(type(v) is int for v in p.liveness[0])


def test_forbidden_everything_names_the_node_or_pair():
    with pytest.raises(PlanError, match=r"node 1 \('relu'\) has no allowed strategy"):
        solve(ShardingProblem(**base(compute=[[0, 0], [math.inf, math.inf]])))
    with pytest.raises(PlanError, match=r"between node 0 \('fc1'\) and node 1 .* forbid every"):
        solve(ShardingProblem(**base(aliases=[(0, 1, [[1, 1], [1, 1]])])))
    with pytest.raises(PlanError, match="time_limit = 0"):
        solve(ShardingProblem(**base()), time_limit=0)


def test_unique_rows_is_numpys_unique_by_rows():
    """reduce_problem groups a matrix's rows by hashing (unique_rows): the same distinct
    rows in the same order, and the same inverse, as np.unique(axis=0), inf, repeated
    rows and -0.0 included."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        r, c = (int(k) for k in rng.integers(1, 10, 2))
        mat = rng.integers(0, 3, (r, c)).astype(float) * rng.choice([1.0, 1e-7])
        if rng.random() < 0.3:
            mat[rng.integers(r), rng.integers(c)] = math.inf
        if rng.random() < 0.2:
            mat[rng.integers(r), rng.integers(c)] = -0.0
        want, inverse = np.unique(mat, axis=0, return_inverse=True)
        got, index = unique_rows(mat)
        assert np.array_equal(got, want) and np.array_equal(index, inverse.reshape(-1))


def test_a_result_freed_before_its_node_lowers_the_peak_the_searches_hold_to():
    """An op's node lives to the last use of any result; one freed earlier (a dropout's
    output read by the residual add, its mask kept for the backward) is released for the
    rest of the node's life. Node 0 (strategies: whole, 8 + 8 bytes; split, 4 + 4 bytes
    but 1 s slower) keeps 8 (or 4) bytes to time 2, where node 1 (6 bytes) is live: under
    a budget of 16 the whole layout fits only with the release counted (16, 8, 14 bytes
    at the three times), and SCIP takes it; the peak is the brute-force walk of the live
    sets."""
    fields = dict(strategy_counts=[2, 1], compute=[[0.0, 1.0], [0.0]],
                  comm=[[0.0, 0.0], [0.0]], memory=[[16.0, 8.0], [6.0]],
                  liveness=[[0], [0], [0, 1]], released=[(0, 1, 2, [8.0, 4.0])])
    p = ShardingProblem(**fields, memory_budget=16)
    for choice in ([0, 0], [1, 0]):     # brute force: each time's live bytes, less freed
        held = [sum(fields["memory"][v][choice[v]] for v in live)
                - sum(b[choice[v]] for v, a, z, b in fields["released"] if a <= t <= z)
                for t, live in enumerate(fields["liveness"])]
        assert peak_memory(p, choice) == max(held)
    assert peak_memory(p, [0, 0]) == 16.0 and p.beside([0, 0]).tolist() == [0, -8, -8]
    assert p.held_at({0}, 2, [0, 0]) == 8.0
    assert list(solve(p, time_limit=60).choice) == [0, 0]
    unreleased = ShardingProblem(**dict(fields, released=()), memory_budget=16)
    assert list(solve(unreleased, time_limit=60).choice) == [1, 0]   # 16 + 6 > 16
    # a stage holding 3 micro-batches: the release counts 3 times too
    assert peak_memory(p.with_held({0}, 3), [0, 0]) == 48.0 and \
        p.with_held({0}, 3).beside([0, 0]).tolist() == [0, -24, -24]


def _walk_with_copies(fields, choice) -> float:
    """The peak of ``choice`` walked from the definitions: at each time the live nodes'
    bytes; beside them, where the running node reads copies, the largest of nothing, the
    copies made with its own results not yet made, and its workspace with the copies
    less the originals they freed; else its workspace."""
    memory, work = fields["memory"], fields["workspace"]
    peak = 0.0
    for t, live in enumerate(fields["liveness"]):
        level = sum(memory[v][choice[v]] for v in live)
        v = fields["running"][t]
        into = [(u, C, F) for u, w, C, F in fields["copies"] if w == v]
        made = sum(C[choice[u]][choice[v]] for u, C, _ in into)
        freed = sum(F[choice[u]][choice[v]] for u, _, F in into)
        beside = max(0, made - memory[v][choice[v]], work[v][choice[v]] + made - freed) \
            if into else work[v][choice[v]]
        peak = max(peak, level + beside)
    return peak


@pytest.mark.parametrize("seed", range(30))
def test_reshard_copies_beside_their_reader_are_held_to_the_budget_as_brute_force_finds(seed):
    """A reshard's copy is made just before its reader runs and its original freed where
    that was its last read (the partitioner's arrays, as the estimate walks them): SCIP
    holds every choice to the budget by that walk (its copy variables exact at every
    pair), and its choice is the brute-force best within the budget."""
    rng = np.random.default_rng(seed)
    n = 5
    counts = [int(rng.integers(1, 4)) for _ in range(n)]
    share = [[1, 2]] if counts[1] == counts[2] and rng.random() < 0.5 else []
    memory = [rng.integers(1, 8, k).astype(float) for k in counts]
    copies = []
    for u, v in [(0, 1), (1, 2), (0, 3), (2, 4), (3, 4)]:
        C = rng.integers(0, 9, (counts[u], counts[v])) * (rng.random((counts[u], counts[v]))
                                                           < 0.7)
        last = u != 0 or v == 3         # node 0 is read by 1 and 3: freed at 3's read
        F = np.where(C > 0, memory[u][:, None], 0.0) if last else np.zeros(C.shape)
        copies.append((u, v, C.astype(float), F))
    fields = dict(strategy_counts=counts,
                  compute=[rng.integers(0, 10, k).astype(float) for k in counts],
                  comm=[np.zeros(k) for k in counts], memory=memory,
                  workspace=[rng.integers(0, 4, k).astype(float) for k in counts],
                  liveness=[[0], [0, 1], [0, 1, 2], [0, 2, 3], [2, 3, 4]],
                  running=[0, 1, 2, 3, 4], copies=copies, share=share)
    choices = [c for c in itertools.product(*[range(k) for k in counts])
               if all(c[v] == c[g[0]] for g in share for v in g)]
    peaks = {c: _walk_with_copies(fields, c) for c in choices}
    budget = float(rng.uniform(min(peaks.values()), max(peaks.values())))
    p = ShardingProblem(**fields, memory_budget=budget)
    for c in choices:
        assert peak_memory(p, c) == pytest.approx(peaks[c])
    cost = {c: sum(fields["compute"][v][c[v]] for v in range(n)) for c in choices}
    best = min(cost[c] for c in choices if peaks[c] <= budget)
    sol = solve(p, time_limit=60)
    assert sol.status == "optimal" and sol.objective == pytest.approx(best)
    assert peaks[tuple(sol.choice)] <= budget + 1e-9
