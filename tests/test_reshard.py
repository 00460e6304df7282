import importlib.util
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distgraph.errors import ShardingError
from distgraph.mesh import ProcessMesh, ProcessRanks
from distgraph.passes.cost.formulas import collective_bytes
from distgraph.passes.reshard import plan_reshard
from distgraph.plan.reshard import format_steps, steps_bytes
from distgraph.placement import DistAttr, ShardSpec
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.launch.launcher import launch_command, rank_env

SCRIPT = Path(__file__).parent / "mpi_scripts" / "reshard_cases.py"
_spec = importlib.util.spec_from_file_location("reshard_cases", SCRIPT)
cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cases)

M22 = ProcessMesh([[0, 1], [2, 3]], ["x", "y"])
M4 = ProcessMesh([0, 1, 2, 3], ["x"])


def plan(src_spec, dst_spec, shape, src_mesh=M22, dst_mesh=None, dtype="float32"):
    return plan_reshard(DistAttr(src_mesh, src_spec), DistAttr(dst_mesh or src_mesh, dst_spec),
                        shape, dtype)


class HypothesisDraw:
    def __init__(self, data):
        self.data = data

    def choice(self, seq):
        return self.data.draw(st.sampled_from(list(seq)))

    def perm(self, seq):
        return self.data.draw(st.permutations(list(seq)))


# ---- the same-mesh table, one row at a time ---------------------------------------------

@pytest.mark.parametrize("src, dst, kind, nbytes", [
    (ShardSpec(["x", None]), ShardSpec([None, None]), "all_gather", 3 * 16 * 4),
    (ShardSpec([None, None]), ShardSpec([None, "x"]), "slice", 0),
    (ShardSpec([None, None], "x"), ShardSpec([None, None]), "all_reduce", 2 * 3 / 4 * 64 * 4),
    (ShardSpec([None, None], "x"), ShardSpec(["x", None]), "reduce_scatter", 3 / 4 * 64 * 4),
    (ShardSpec(["x", None]), ShardSpec([None, "x"]), "all_to_all", 3 / 4 * 16 * 4),
    (ShardSpec([None, None]), ShardSpec([None, None], "x"), "make_partial", 0),
])
def test_single_step_per_table_row(src, dst, kind, nbytes):
    steps = plan(src, dst, (8, 8), src_mesh=M4)
    assert [s.kind for s in steps] == [kind]
    assert steps[0].bytes == nbytes and steps_bytes(steps) == nbytes
    assert steps[0].mesh_dim == "x" and steps[0].group_size == 4


def test_identical_attrs_need_no_steps():
    assert plan(ShardSpec(["x", "y"]), ShardSpec(["x", "y"]), (4, 4)) == []


def test_step_str_and_fields():
    (step,) = plan(ShardSpec(["x", None]), ShardSpec([None, None]), (16, 16))
    assert str(step) == "all_gather(x) dim0 n=2 512 B"
    assert (step.tensor_dim, step.buffer_bytes, step.before, step.after) == \
        (0, 1024, ShardSpec(["x", None]), ShardSpec([None, None]))
    (a2a,) = plan(ShardSpec(["x", None]), ShardSpec([None, "x"]), (4, 4))
    assert str(a2a) == "all_to_all(x) dim0->dim1 n=2 16 B"
    assert (a2a.tensor_dim, a2a.to_tensor_dim) == (0, 1)
    assert "all_gather(x)" in format_steps([step]) and format_steps([]) == "(no steps)"


def test_tuple_entry_order_is_respected():
    # (x, y) -> (y, x): no single step applies; the plan must end at the exact order
    steps = plan(ShardSpec([("x", "y"), None]), ShardSpec([("y", "x"), None]), (8, 4))
    assert steps[-1].after == ShardSpec([("y", "x"), None])
    for a, b in zip(steps, steps[1:]):
        assert a.after == b.before
    # only the minor-most mesh dim of an entry is ever gathered
    (step,) = plan(ShardSpec([("x", "y")]), ShardSpec(["x"]), (8,))
    assert (step.kind, step.mesh_dim) == ("all_gather", "y")


def test_plans_respect_divisibility_of_every_intermediate():
    for step in plan(ShardSpec(["x", "y"]), ShardSpec(["y", "x"]), (2, 2)):
        step.src_attr.local_shape(step.shape)
        step.dst_attr.local_shape(step.shape)


def test_invalid_endpoints_raise_sharding_error():
    with pytest.raises(ShardingError, match="reshard source.*not divisible"):
        plan(ShardSpec(["x"]), ShardSpec([None]), (3,))
    with pytest.raises(ShardingError, match="reshard destination.*2 entries for a 1-d"):
        plan(ShardSpec([None]), ShardSpec([None, None]), (4,))


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_moving_one_mesh_dim_between_tensor_dims_is_one_all_to_all(data):
    draw = HypothesisDraw(data)
    mesh = cases.draw_mesh(draw, 8)
    ndim = draw.choice([2, 3])
    base = cases.draw_spec(draw, mesh, ndim)
    free = [m for m in mesh.dim_names if m not in base.mesh_dims()]
    if not free:
        return
    m = draw.choice(free)
    i, j = draw.perm(range(ndim))[:2]
    entries = [list(base.entry(d)) for d in range(ndim)]
    src = ShardSpec([tuple(e + [m]) if d == i else tuple(e) for d, e in enumerate(entries)],
                    base.partial)
    dst = ShardSpec([tuple(e + [m]) if d == j else tuple(e) for d, e in enumerate(entries)],
                    base.partial)
    shape = tuple(math.lcm(DistAttr(mesh, src).parts(d), DistAttr(mesh, dst).parts(d))
                  for d in range(ndim))
    steps = plan(src, dst, shape, src_mesh=mesh)
    if mesh.dim_size(m) > 1:
        assert [(s.kind, s.mesh_dim, s.tensor_dim, s.to_tensor_dim) for s in steps] == \
            [("all_to_all", m, i, j)]


# ---- cross mesh --------------------------------------------------------------------------

def test_cross_mesh_local_all_gather_and_balanced_senders():
    src = DistAttr(ProcessMesh([[0, 1], [2, 3]], ["x", "y"]), ShardSpec(["x", None]))
    dst = DistAttr(ProcessMesh([[4, 5], [6, 7]], ["a", "b"]), ShardSpec(["a", None]))
    steps = plan_reshard(src, dst, (8, 8), "float64")
    assert [s.kind for s in steps] == ["send_recv", "all_gather"]
    p2p, gather = steps
    assert (gather.mesh_dim, gather.mesh) == ("b", dst.mesh)
    # every destination process receives a distinct quarter once (no duplicate tiles)
    assert sorted(t.dst for t in p2p.transfers) == [4, 5, 6, 7]
    assert all(t.nbytes == 2 * 8 * 8 for t in p2p.transfers)
    # the two replicas of each source block share the sending
    assert sorted(t.src for t in p2p.transfers) == [0, 1, 2, 3]
    assert p2p.bytes == 128 and str(p2p) == "send_recv 4 tiles max 128 B"


def test_cross_mesh_reduces_partial_inside_the_source_first():
    src = DistAttr(ProcessMesh([0, 1], ["x"]), ShardSpec([None, None], "x"))
    dst = DistAttr(ProcessMesh([2, 3, 4], ["z"]), ShardSpec([None, "z"]))
    steps = plan_reshard(src, dst, (4, 6))
    assert steps[0].kind == "reduce_scatter" and steps[0].mesh == src.mesh
    assert steps[1].kind == "send_recv" and steps[1].dst_mesh == dst.mesh


def test_cross_mesh_partial_destination_receives_on_coordinate_zero_only():
    src = DistAttr(ProcessMesh([0], ["x"]), ShardSpec([None]))
    dst = DistAttr(ProcessMesh([1, 2], ["p"]), ShardSpec([None], "p"))
    (step,) = plan_reshard(src, dst, (4,))
    assert [(t.src, t.dst) for t in step.transfers] == [(0, 1)]


def _tiles_one_by_one(src, dst, shape, itemsize):
    """The p2p tiles by their definition, one tile at a time: every (receiver, source
    region) that meet, receiver-major; a receiver that holds the region copies it, the
    others get it from the least-loaded replica (ties: the first from the tile's turn)."""
    holders = {}
    for p in src.mesh.process_ids:
        box = tuple((s.start, s.stop) for s in src.local_slices(shape, p))
        holders.setdefault(box, []).append(p)
    partial = [dst.mesh.dim_index(m) for m in dst.spec.partial]
    tiles = []
    for q in dst.mesh.process_ids:
        if any(dst.mesh.coord(q)[a] for a in partial):
            continue
        want = dst.local_slices(shape, q)
        for r, box in enumerate(holders):
            region = tuple((max(a, w.start), min(b, w.stop)) for (a, b), w in zip(box, want))
            if all(a < b for a, b in region):
                tiles.append([None, q, region, math.prod(b - a for a, b in region) * itemsize,
                              r])
    load = dict.fromkeys(src.mesh.process_ids, 0)
    for r, pids in enumerate(holders.values()):
        turn = 0
        for tile in (t for t in tiles if t[4] == r):
            if tile[1] in pids:
                tile[0] = tile[1]
                continue
            j = min(range(len(pids)), key=lambda j: (load[pids[j]], (j - turn) % len(pids)))
            tile[0] = pids[j]
            load[pids[j]] += tile[3]
            turn += 1
    return [tuple(t[:4]) for t in tiles], max(load.values())


@pytest.mark.parametrize("src,dst,shape", [
    (DistAttr(ProcessMesh([[0, 1], [2, 3]], ["x", "y"]), ShardSpec(["x", None])),
     DistAttr(ProcessMesh([[2, 3, 4], [5, 6, 7]], ["a", "b"]), ShardSpec([None, "b"])),
     (8, 6)),
    (DistAttr(ProcessMesh([0, 1, 2], ["x"]), ShardSpec(["x", None])),
     DistAttr(ProcessMesh([[3, 4], [5, 6]], ["a", "b"]), ShardSpec(["a", None], "b")),
     (12, 4)),
    (DistAttr(ProcessMesh([[0, 1], [2, 3]], ["x", "y"]), ShardSpec([None, ("x", "y")])),
     DistAttr(ProcessMesh([0, 1, 2, 3, 4, 5], ["w"]), ShardSpec(["w", None])), (6, 8)),
    (DistAttr(ProcessMesh([[0, 1], [2, 3]], ["x", "y"]), ShardSpec([None, None])),
     DistAttr(ProcessMesh(list(range(4, 20)), ["w"]), ShardSpec([None, None])), (3, 5)),
])
def test_cross_mesh_tiles_are_those_of_their_definition(src, dst, shape):
    """The array form of the p2p tiles (uneven tiles, a Partial destination, shared and
    local senders) gives the tiles, senders and busiest sender of the definition."""
    from distgraph.passes.reshard import _send_recv_step

    step = _send_recv_step(src, dst, shape, "float64")
    tiles, busiest = _tiles_one_by_one(src, dst, shape, 8)
    assert [(t.src, t.dst, t.region, t.nbytes) for t in step.transfers] == tiles
    assert step.buffer_bytes == busiest


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_cross_mesh_tiles_are_those_of_their_definition(data):
    """On random meshes and specs (Partial destinations included) the p2p tiles found
    without the dense receivers x regions test are the definition's."""
    from distgraph.passes.reshard import _send_recv_step

    draw = HypothesisDraw(data)
    src, dst, shape = cases.draw_case(draw, 8)
    src = DistAttr(src.mesh, ShardSpec([src.spec.entry(i) or None for i in range(len(shape))]))
    dst = DistAttr(ProcessMesh(np.array(dst.mesh.process_ids).reshape(dst.mesh.shape) + 8,
                               list(dst.mesh.dim_names)), dst.spec)
    step = _send_recv_step(src, dst, shape, "float64")
    tiles, busiest = _tiles_one_by_one(src, dst, shape, 8)
    assert [(t.src, t.dst, t.region, t.nbytes) for t in step.transfers] == tiles
    assert step.buffer_bytes == busiest


@pytest.mark.parametrize("seed", range(20))
def test_boxes_that_meet_are_those_of_the_dense_test(seed):
    """_meeting gives the pairs of boxes that meet in np.nonzero's order of the dense
    receivers x regions test, on random boxes (uneven, overlapping, empty sets, 0-d),
    whether it makes that test or not."""
    from distgraph.passes.reshard import _meeting

    rng = np.random.default_rng(seed)
    ndim = int(rng.integers(0, 4))

    def boxes(n):
        lo = rng.integers(0, 6, size=(n, ndim))
        return np.stack([lo, lo + rng.integers(1, 4, size=(n, ndim))], axis=2)

    wanted, held = boxes(int(rng.integers(0, 12))), boxes(int(rng.integers(0, 12)))
    lo = np.maximum(wanted[:, None, :, 0], held[None, :, :, 0])
    hi = np.minimum(wanted[:, None, :, 1], held[None, :, :, 1])
    ks, rs = np.nonzero((lo < hi).all(axis=2))
    for dense_up_to in (0, 1 << 16):        # found without the dense test, and with it
        got = _meeting(wanted, held, dense_up_to)
        assert got[0].tolist() == ks.tolist() and got[1].tolist() == rs.tolist()


def test_same_processes_other_names_plan_on_one_mesh():
    other = ProcessMesh([[0, 1], [2, 3]], ["a", "b"])
    steps = plan(ShardSpec(["x", None]), ShardSpec([None, "a"]), (4, 4), dst_mesh=other)
    assert [s.kind for s in steps] == ["all_to_all"]


# ---- bytes: plan = cost formula = communicator counters, and exact results ------------------

def formula_bytes(step) -> float:
    """The cost formula with B recomputed from the step's before/after layouts."""
    itemsize = np.dtype(step.dtype).itemsize
    before = math.prod(step.src_attr.local_shape(step.shape)) * itemsize
    after = math.prod(step.dst_attr.local_shape(step.shape)) * itemsize
    if step.kind == "send_recv":
        return max((step.bytes_sent_by(p) for p in step.mesh.process_ids), default=0.0)
    buffer = {"all_gather": after}.get(step.kind, before)
    return collective_bytes(step.kind, step.group_size, buffer)


def check_plan_bytes(steps):
    for step in steps:
        assert math.isclose(step.bytes, formula_bytes(step), abs_tol=1e-9), str(step)
    for step in steps:
        if step.kind == "send_recv":
            for t in step.transfers:
                assert t.nbytes == math.prod(t.shape) * np.dtype(step.dtype).itemsize


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_reshards_are_exact_and_count_the_planned_bytes(data):
    src, dst, shape = cases.draw_case(HypothesisDraw(data), 8)
    steps = plan_reshard(src, dst, shape, "float64")
    check_plan_bytes(steps)
    for a, b in zip(steps, steps[1:]):
        assert a.after == b.before or a.kind == "send_recv" or b.kind == "send_recv"
    full = cases.global_tensor(shape)
    locals_ = cases.make_locals(src, full)
    world = SimulatedWorld(8, timeout=30)
    results = world.run(lambda comm: cases.run_steps(steps, locals_.get(comm.rank), comm,
                                                     comm.rank))
    cases.check_case(src, dst, shape, dict(enumerate(results)), steps)


def test_process_ranks_map_process_ids_to_ranks():
    mesh = ProcessMesh([[10, 11], [12, 13]], ["x", "y"])
    other = ProcessMesh([20, 21], ["z"])
    src, dst = DistAttr(mesh, ShardSpec(["x", "y"], ())), DistAttr(other, ShardSpec([None, "z"]))
    steps = plan_reshard(src, dst, (4, 4), "float64")
    full = cases.global_tensor((4, 4))
    locals_ = cases.make_locals(src, full)
    pids = [10, 11, 12, 13, 20, 21]
    ranks = ProcessRanks({p: r for r, p in enumerate(pids)})
    results = SimulatedWorld(6, timeout=30).run(
        lambda comm: cases.run_steps(steps, locals_.get(pids[comm.rank]), comm,
                                     pids[comm.rank], ranks))
    cases.check_case(src, dst, (4, 4), dict(zip(pids, results)), steps)


@pytest.mark.mpi
def test_fixed_cases_on_four_mpi_ranks():
    proc = subprocess.run(launch_command(4, [str(SCRIPT)]), env=rank_env(),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "reshard-mpi OK 47 cases" in proc.stdout
    for kind in ("all_to_all", "reduce_scatter", "send_recv", "make_partial"):
        assert kind in proc.stdout


def test_step_kinds_parse_from_kinds_and_names_alike():
    from distgraph.errors import PlanError
    from distgraph.plan.kinds import ALL_TO_ALLV, StepKind

    for kind in StepKind:
        assert StepKind.parse(kind) is kind and StepKind.parse(kind.value) is kind
    assert StepKind.parse(ALL_TO_ALLV) is StepKind.ALL_TO_ALL
    with pytest.raises(PlanError, match="unknown communication kind 'gather'"):
        StepKind.parse("gather")
