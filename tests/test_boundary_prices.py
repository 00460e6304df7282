"""Boundary and point-to-point prices on arrays and memos, against the plain path.

The stage search prices each stage's boundary (passes/cost/boundary.py) from
cross-mesh reshards whose send_recv steps carry hundreds of tiles. The fast path looks a
message's device pairs up at once (``Cluster.pairs``), prices a send_recv's messages
once for every process that asks (``steps_time``) and keeps each Value's steps and price
in a memo by what they read. Oracles, equal to the last bit: each pair looked up alone
(``Cluster.bandwidth`` / ``latency``), the tiles summed one by one in transfer order, the
steps priced process by process with ``reshard_step_time``, a ring's hops one by one,
and each option's boundary planned and priced afresh along the module docstring's
recipe; on shipped cluster files whose devices differ (GPUs and XPUs, a slow machine, machines whose ids interleave).
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

import distgraph as dg
import distgraph.resources
from distgraph.errors import PlanError
from distgraph.passes.cost.formulas import link_rates
from distgraph.passes.cost.prices import (Rings, groups_along, reshard_step_time,
                                          send_recv_time, software_time, steps_time)
from distgraph.passes.reshard import plan_reshard
from distgraph.passes.cost.boundary import _value_seconds, boundary_seconds, pieces
from distgraph.passes.search.stages.layers import block_layers
from distgraph.passes.search.stages.runs import RunCosts
from distgraph.passes.search.layouts.space import layouts
from distgraph.plan.kinds import StepKind
from distgraph.program_builder import build_program
from distgraph.passes.session import Session

import plans as P

HERE = os.path.dirname(os.path.abspath(__file__))
CLUSTERS = os.path.join(os.path.dirname(distgraph.resources.__file__), "clusters")
# devices that differ: GPUs and XPUs, a machine at half speed, interleaved ids, 2 DGX-like
FILES = [os.path.join(CLUSTERS, f) for f in ("hetero_2gpu_2xpu.yaml", "emulated_mixed_2x2.yaml",
                                             "gpu_2x8.yaml", "paddle_2x8.json")] + \
    [os.path.join(HERE, "clusters", "two_hosts_interleaved.yaml")]


def load(path):
    return dg.Cluster.from_file(path)


def plain_message(step, cluster, device_of, scale=1.0) -> float:
    """A send_recv's messages tile by tile, each pair looked up alone."""
    per_sender: dict = {}
    for t in step.transfers:
        if t.src != t.dst:
            a, b = device_of(t.src), device_of(t.dst)
            alpha, beta = link_rates(cluster.bandwidth(a, b), cluster.latency(a, b))
            per_sender[t.src] = per_sender.get(t.src, 0.0) + alpha + beta * t.nbytes * scale
    return max(per_sender.values(), default=0.0)


def plain_step(step, p, rings, scale=1.0) -> float:
    """reshard_step_time with a send_recv's messages priced tile by tile."""
    if step.kind is not StepKind.SEND_RECV:
        return reshard_step_time(step, p, rings, scale)
    if p not in step.mesh and p not in step.dst_mesh:
        return 0.0
    return plain_message(step, rings.cluster, rings.device_of, scale) + software_time(
        rings.device(p), step.kind, step.buffer_bytes * scale, step.group_size)


@pytest.mark.parametrize("path", FILES + [os.path.join(CLUSTERS, "dgx_a100_1024.yaml")],
                         ids=os.path.basename)
def test_pairs_are_each_pairs_figures(path):
    """Every pair of a small file's devices and NICs; 20,000 random pairs of the 1,024
    GPUs' (their paths come from a few machines of each kind: symmetry.py)."""
    cluster = load(path)
    ids = [d.global_id for d in cluster.devices] + [n.global_id for n in cluster.nics]
    a = [x for x in ids for _ in ids]
    b = [y for _ in ids for y in ids]
    if len(ids) > 100:
        rng = random.Random(3)
        a = [rng.choice(ids) for _ in range(20_000)]
        b = [rng.choice(ids) for _ in range(20_000)]
    bw, lat = cluster.pairs(a, b)
    assert bw.tolist() == [cluster.bandwidth(x, y) for x, y in zip(a, b)]
    assert lat.tolist() == [cluster.latency(x, y) for x, y in zip(a, b)]
    assert [x.size for x in cluster.pairs([], [])] == [0, 0]
    with pytest.raises(PlanError, match="not a device"):
        cluster.pairs([ids[0]], [max(ids) + 1000])
    with pytest.raises(PlanError, match="one of each per pair"):
        cluster.pairs(ids[:2], ids[:1])


def cross_mesh_steps(cluster, rng, cases: int):
    """(steps, device_of) of reshards between two meshes of random shapes placed on
    random devices of ``cluster``, in random layouts."""
    devices = [d.global_id for d in cluster.devices]
    found = []
    while len(found) < cases:
        size = rng.choice([s for s in (1, 2, 4) if 2 * s <= len(devices)])
        shape = rng.choice([(size,), (size // 2, 2)] if size > 2 else [(size,)])
        names = ["x", "y"][:len(shape)]
        here = dg.ProcessMesh(np.arange(size).reshape(shape).tolist(), names)
        there = dg.ProcessMesh(np.arange(size, 2 * size).reshape(shape).tolist(), names)
        placed = rng.sample(devices, 2 * size)
        tensor = tuple(rng.choice([4, 8, 12, 16]) for _ in range(rng.randint(1, 3)))
        src = rng.choice(layouts(tensor, here)).out_specs[0]
        dst = rng.choice(layouts(tensor, there)).out_specs[0]
        steps = plan_reshard(dg.DistAttr(here, src), dg.DistAttr(there, dst), tensor,
                             rng.choice(["float32", "bfloat16"]))
        found.append((steps, placed.__getitem__, 2 * size))
    return found


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_send_recv_and_steps_time_equal_the_plain_path(path):
    cluster = load(path)
    rng = random.Random(os.path.basename(path))
    messages = senders = 0
    for steps, device_of, n in cross_mesh_steps(cluster, rng, 60):
        rings = Rings(cluster, device_of)
        for scale in (1.0, 0.37, 3.0):
            for s in steps:
                if s.kind is StepKind.SEND_RECV:
                    assert send_recv_time(s, cluster, device_of, scale) == \
                        plain_message(s, cluster, device_of, scale)
                    messages += 1
                    senders += len({t.src for t in s.transfers if t.src != t.dst}) > 1
            # every process, involved or not (one beyond both meshes)
            processes = list(range(n + 1))
            assert steps_time(steps, processes, rings, scale) == \
                [sum(plain_step(s, p, rings, scale) for s in steps) for p in processes]
    assert messages > 100 and senders > 20


def run_costs(cluster) -> RunCosts:
    dims = dict(P.GPT_DIMS, n_layer=4)
    data = P.Dataset("gpt", dims=dims, batch=16)
    ins, labels = dg.app.data.DataLoader(data, 16).specs(1)
    prepared = build_program(P.build_model("gpt", dims=dims), ins, labels, P.loss_fn("gpt"),
                         dg.optim.AdamW(0.01))
    layering = block_layers(prepared.program, prepared.block_paths)
    return RunCosts(prepared, dg.Strategy(auto_mode="full", pipeline=True), cluster, layering,
                    micro=4)


def plain_boundary(option, cluster) -> float:
    """The boundary of ``option`` as the module docstring of boundary.py describes it,
    each Value planned and priced afresh, process by process, tile by tile."""
    sides = pieces(option.sub)
    if len(sides) < 2:
        return 0.0
    result = option.parts["block"][1]
    space, choice = result.space, result.choice
    names = list(space.mesh.dim_names)
    total = 0.0
    for received, _ in result.boundary.periodic:
        node = space.source_node[received]
        spec = space.nodes[node].strategies[choice[node]].out_specs[0]
        value = space.program.values[received]
        split = names[0] in spec.mesh_dims() and names[0] not in spec.partial
        n = option.logical[0] if split else 1
        logical = (option.logical[0] // n,) + tuple(option.logical[1:])
        shape = tuple(d // n if names[0] in spec.entry(i) else d
                      for i, d in enumerate(value.shape))
        size = int(np.prod(logical))
        devices = [int(d) for d in sides[0][:size]] + [int(d) for d in sides[1][:size]]
        ids = np.arange(2 * size)
        here = dg.ProcessMesh(ids[:size].reshape(logical).tolist(), names)
        there = dg.ProcessMesh(ids[size:].reshape(logical).tolist(), names)
        steps = plan_reshard(dg.DistAttr(here, spec), dg.DistAttr(there, spec), shape,
                             value.dtype)
        rings = Rings(cluster, devices.__getitem__)
        t = logical[-1]
        for side in (range(t), range(size, size + t)):
            total += max(sum(plain_step(s, p, rings) for s in steps) for p in side)
    return total


@pytest.mark.parametrize("name", ["emulated_mixed_2x2.yaml", "hetero_2gpu_2xpu.yaml"])
def test_boundaries_from_one_memo_equal_each_planned_afresh(name):
    """One session's table shared by every option (the stage search's), in two orders,
    gives each option's boundary planned and priced afresh: its keys hold all the prices
    read."""
    cluster = load(os.path.join(CLUSTERS, name))
    runs = run_costs(cluster)
    options = runs.options() + runs.options(variants=True)
    want = [plain_boundary(o, cluster) for o in options]
    assert any(w > 0 for w in want)
    for order in (options, options[::-1]):
        session = Session()
        got = {id(o): boundary_seconds(o, cluster, session) for o in order}
        assert [got[id(o)] for o in options] == want
        # Values shared between options: fewer prices kept than Values priced
        memo = session.table("boundary prices")
        assert sum(k[0] == "value" for k in memo) < sum(
            len(o.parts["block"][1].boundary.periodic) for o in options
            if len(pieces(o.sub)) > 1)
    assert [runs.p2p_seconds(o) for o in options] == want


def test_one_value_priced_on_other_devices_is_priced_again():
    """The memo keys a Value's price by its devices: on a cluster whose machines differ,
    the same reshard between other devices costs what a fresh pricing says."""
    cluster = load(os.path.join(CLUSTERS, "emulated_mixed_2x2.yaml"))
    spec = dg.ShardSpec(["x", None])
    reshard = ((2,), ("x",), spec, (8, 4), "float32")
    memo = Session().table("boundary prices")
    inside = _value_seconds(reshard, (0, 1, 2, 3), cluster, memo)
    across = _value_seconds(reshard, (0, 2, 1, 3), cluster, memo)
    assert inside != across
    assert across == _value_seconds(reshard, (0, 2, 1, 3), cluster,
                                    Session().table("boundary prices"))
    assert list(memo) == [("steps",) + reshard]


def plain_ring(rings, mesh, dims, group) -> tuple:
    """A group's (bandwidth, latency) hop by hop, each pair looked up alone, the hops that
    cross machines sharing their interfaces with the other groups' or striped over them
    (prices.py's model)."""
    cluster, device_of = rings.cluster, rings.device_of
    machine = {d.global_id: d.machine_id for d in cluster.devices}
    nics = {m.id: max(1, len(m.nics)) for m in cluster.machines}
    crossing: dict = {}
    fewest: dict = {}
    for other in groups_along(mesh, dims):
        ring = [machine[device_of(q)] for q in other]
        for a, b in zip(ring, ring[1:] + ring[:1]):
            if a != b:
                crossing[a, b] = crossing.get((a, b), 0) + 1
                fewest[a, b] = min(fewest.get((a, b), len(ring)), ring.count(a),
                                   ring.count(b))
    devices = [device_of(q) for q in group]
    hops = [(a, b) for a, b in zip(devices, devices[1:] + devices[:1]) if a != b]
    share = {k: 1.0 / min(fewest[k], min(nics[k[0]], nics[k[1]]) / n)
             for k, n in crossing.items()}
    bw = min((cluster.bandwidth(a, b) / share.get((machine[a], machine[b]), 1.0)
              for a, b in hops), default=float("inf"))
    return bw, max((cluster.latency(a, b) for a, b in hops), default=0.0)


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_rings_equal_hop_by_hop(path):
    cluster = load(path)
    rng = random.Random(os.path.basename(path) + "rings")
    devices = [d.global_id for d in cluster.devices]
    checked = 0
    for _ in range(40):
        size = rng.choice([s for s in (2, 4, 8, 16) if s <= len(devices)])
        shape = rng.choice([(size,), (2, size // 2), (size // 2, 2)])
        names = ["x", "y"][:len(shape)]
        mesh = dg.ProcessMesh(np.arange(size).reshape(shape).tolist(), names)
        rings = Rings(cluster, rng.sample(devices, size).__getitem__)
        for dims in [(d,) for d in names] + [tuple(names)]:
            for p in mesh.process_ids:
                ring = rings.along(mesh, p, dims)
                group = rings._group_of(mesh, dims)[p]
                assert (ring.bandwidth, ring.latency) == plain_ring(rings, mesh, dims, group)
                checked += 1
    assert checked > 250


@pytest.mark.parametrize("t, times", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_a_ring_stripes_its_crossing_over_the_nics_its_members_reach(t, times):
    """Data-parallel rings of 32 GPUs over DGX A100 nodes (8 GPUs, 8 HCAs at 24 GB/s each,
    NVLink 230 GB/s): with t tensor-parallel ranks per node, t rings cross between two
    nodes at once, each with 8 / t members per node, so each stripes over 8 / t HCAs
    (NCCL's channels cross at other members); one ring per node reaches 8 HCAs, bounded
    then by the 192 GB/s of 8 x 24 < 230. The tensor-parallel rings stay inside a node."""
    cluster = load(os.path.join(CLUSTERS, "dgx_a100_1024.yaml"))
    gpus = 32 * t
    mesh = dg.ProcessMesh(np.arange(gpus).reshape(32, t).tolist(), ["dp", "mp"])
    rings = Rings(cluster, lambda p: p)
    hca = cluster.bandwidth(0, 8)
    assert hca == 24.0
    assert rings.along(mesh, 0, "dp").bandwidth == min(230.0, times * hca)
    if t > 1:
        assert rings.along(mesh, 0, "mp").bandwidth == 230.0


def test_a_machine_of_one_nic_shares_it_and_stripes_nothing():
    """Two machines of 8 GPUs and one NIC each (12.5 GB/s between them): a ring of all 16
    crosses at full speed, eight rings of 2 (one per GPU pair) share the NIC 8 ways."""
    cluster = load(os.path.join(CLUSTERS, "gpu_2x8.yaml"))
    rings = Rings(cluster, lambda p: cluster.devices[p].global_id)
    whole = dg.ProcessMesh(list(range(16)), ["x"])
    assert rings.along(whole, 0, "x").bandwidth == 12.5
    pairs = dg.ProcessMesh(np.arange(16).reshape(2, 8).tolist(), ["x", "y"])
    assert rings.along(pairs, 0, "x").bandwidth == 12.5 / 8
