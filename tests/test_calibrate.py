"""Calibration's fits against closed forms: what a reshard step costs beyond its
messages' alpha-beta, per step and per byte, from timings at several buffer sizes."""

import dataclasses

import pytest

import distgraph as dg
from distgraph.passes.cost.formulas import collective_time
from distgraph.tools.calibrate import build_cluster
from distgraph.tools.software_fit import reshard_overheads

BW, LAT = 2.0, 5.0


def two_cpus():
    return dg.Cluster.from_dict({"machines": [{"hostname": "a", "devices": [
        {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float32": 10}}
        for i in range(2)], "links": [{"group": [0, 1], "bandwidth": BW, "latency": LAT}]}]})


def test_reshard_overheads_recover_the_per_step_and_per_byte_cost():
    """Timings that are the links' alpha-beta plus ``a + b x B`` give back (a µs, b ns
    per byte); a local step (no messages) is its timing; one size gives the µs alone."""
    a, b = 40e-6, 0.3e-9
    sizes = (4096, 65536, 1 << 20)
    steps = {"all_gather": [(B, collective_time("all_gather", 2, B, BW, LAT) + a + b * B)
                            for B in sizes],
             "slice": [(B, 25e-6) for B in sizes],
             "all_reduce": [(4096, collective_time("all_reduce", 2, 4096, BW, LAT) + 7e-6)]}
    out = reshard_overheads(two_cpus(), steps)
    assert out["all_gather"] == pytest.approx((40.0, 0.3), rel=1e-6)
    assert out["slice"] == pytest.approx((25.0, 0.0), abs=1e-6)
    assert out["all_reduce"] == pytest.approx((7.0, 0.0), rel=1e-6)


def test_a_step_over_four_ranks_is_fitted_per_ring_round():
    """Timings of steps over 4 ranks that are the links' alpha-beta plus ``3 a + b x B``
    (a 2-rank step's ``a`` at each of the ring's 3 rounds) give back (a, b), and the
    model charges the 4-rank step what was measured and a 2-rank step a."""
    a, b = 40e-6, 0.3e-9
    cluster = dg.Cluster.from_dict({"machines": [{"hostname": "h", "devices": [
        {"global_id": i, "type": "CPU", "memory": 1, "gflops": {"float32": 10}}
        for i in range(4)], "links": [{"group": [0, 1, 2, 3], "bandwidth": BW,
                                       "latency": LAT}]}]})
    sizes = (4096, 65536, 1 << 20)
    steps = {"all_gather": [(B, collective_time("all_gather", 4, B, BW, LAT) + 3 * a + b * B)
                            for B in sizes]}
    out = reshard_overheads(cluster, steps)
    assert out["all_gather"] == pytest.approx((40.0, 0.3), rel=1e-6)
    from distgraph.passes.cost.prices import software_time
    device = dataclasses.replace(cluster.devices[0], reshard_overhead=out)
    assert software_time(device, "all_gather", 4096, n=4) == pytest.approx(
        3 * a + b * 4096, rel=1e-6)
    assert software_time(device, "all_gather", 4096, n=2) == pytest.approx(
        a + b * 4096, rel=1e-6)


def test_steps_over_pairs_and_all_four_ranks_fit_a_cost_per_further_round(tmp_path):
    """Collectives timed over pairs of ranks (group size 2, on the pairs' own links) and
    over all 4 (3 ring rounds) as alpha-beta plus ``a_k + r x (rounds - 1) + b_k x B``
    give back each kind's (a_k, b_k) and the shared ``ring_round`` r; a step timed over
    all ranks only (send_recv, all_to_allv) is taken less its further rounds. The file
    keeps the figures, and the model charges each group size what was measured."""
    from distgraph.passes.cost.prices import Rings, software_time
    from distgraph.mesh import ProcessMesh

    near, far = (8.0, 2.0), (1.0, 50.0)       # inside a pair, between the pairs
    cluster = dg.Cluster.from_dict({"machines": [
        {"hostname": f"h{m}", "devices": [
            {"global_id": 2 * m + i, "type": "CPU", "memory": 1, "gflops": {"float32": 10}}
            for i in range(2)],
         "links": [{"group": [2 * m, 2 * m + 1], "bandwidth": near[0], "latency": near[1]}]}
        for m in range(2)],
        "links": [{"source": a, "target": b, "bandwidth": far[0], "latency": far[1]}
                  for a in (0, 1) for b in (2, 3)]})
    rings = Rings(cluster, lambda p: p)
    whole = rings.along(ProcessMesh([0, 1, 2, 3], ["x"]), 0, "x")
    pair = rings.along(ProcessMesh([[0, 1], [2, 3]], ["x", "y"]), 0, "y")
    a = {"all_reduce": 300e-6, "all_gather": 200e-6}
    b = {"all_reduce": 0.4e-9, "all_gather": 0.1e-9}
    r = 70e-6
    sizes = (4096, 65536, 1 << 20)
    steps = {}
    for kind in a:
        steps[kind] = [(B, whole.seconds(kind, 4, B)
                        + a[kind] + 2 * r + b[kind] * B) for B in sizes]
        steps[kind] += [(B, pair.seconds(kind, 2, B)
                         + a[kind] + b[kind] * B, 2) for B in sizes]
    steps["all_to_allv"] = [(B, whole.seconds("all_to_all", 4, B) + 90e-6 + 2 * r)
                            for B in (1 << 18, 1 << 20)]
    out = reshard_overheads(cluster, steps)
    assert out["all_reduce"] == pytest.approx((300.0, 0.4), rel=1e-4)
    assert out["all_gather"] == pytest.approx((200.0, 0.1), rel=1e-4)
    assert out["ring_round"] == pytest.approx((70.0, 0.0), rel=1e-4)
    assert out["all_to_allv"] == pytest.approx((90.0, 0.0), abs=1e-3)
    ranks = [{"rank": k, "host": f"h{k // 2}", "model": "cpu", "memory": 8.0,
              "gflops": {"float32": 10.0}} for k in range(4)]
    pairs = {(x, y): near if x // 2 == y // 2 else far
             for x in range(4) for y in range(x + 1, 4)}
    build_cluster(ranks, pairs, None, "calibrated4", steps).save(tmp_path / "c.yaml")
    device = dg.Cluster.from_file(tmp_path / "c.yaml").devices[0]
    assert device.reshard_overhead["ring_round"] == pytest.approx((70.0, 0.0), rel=1e-4)
    for n, rounds in ((2, 0), (4, 2)):
        assert software_time(device, "all_reduce", 65536, n=n) == pytest.approx(
            300e-6 + rounds * r + 0.4e-9 * 65536, rel=1e-4)
    assert software_time(device, "slice", 0, n=4) == 0.0      # not measured


def test_a_step_faster_than_its_links_costs_nothing_more():
    """Measured below the alpha-beta charge (a fast shared-memory copy): no negative cost."""
    steps = {"all_reduce": [(B, 0.5 * collective_time("all_reduce", 2, B, BW, LAT))
                            for B in (4096, 1 << 20)]}
    assert reshard_overheads(two_cpus(), steps)["all_reduce"] == (0.0, 0.0)


def test_the_calibrated_file_carries_the_fit_and_the_estimate_charges_it(tmp_path):
    ranks = [{"rank": r, "host": "h", "model": "cpu", "memory": 8.0,
              "gflops": {"float32": 10.0}} for r in range(2)]
    pairs = {(0, 1): (BW, LAT)}
    B = 1 << 20
    steps = {"all_gather": [(n, collective_time("all_gather", 2, n, BW, LAT) + 1e-5 + 1e-9 * n)
                            for n in (4096, B)]}
    cluster = build_cluster(ranks, pairs, None, "calibrated2", steps)
    cluster.save(tmp_path / "c.yaml")
    device = dg.Cluster.from_file(tmp_path / "c.yaml").devices[0]
    assert device.reshard_overhead["all_gather"] == pytest.approx((10.0, 1.0), rel=1e-6)
    from distgraph.passes.cost.prices import software_time
    assert software_time(device, "all_gather", B) == pytest.approx(1e-5 + 1e-9 * B, rel=1e-6)


def test_the_variable_all_to_all_is_fitted_apart_and_priced_by_moes_dispatch(tmp_path):
    """``all_to_allv`` timings (MoE's dropless dispatch) fit their own entry on
    all_to_all's formula; an op's ``all_to_allv`` is charged it, and a file without it
    charges the all_to_all's."""
    from distgraph.passes.cost.prices import op_collective_time, software_time
    from distgraph.passes.cost.prices import Ring
    from distgraph.resources.elements import Device

    sizes = (1 << 18, 1 << 20, 1 << 22)
    steps = {"all_to_all": [(B, collective_time("all_to_all", 2, B, BW, LAT) + 9e-5)
                            for B in sizes],
             "all_to_allv": [(B, collective_time("all_to_all", 2, B, BW, LAT) + 2e-5 + 2e-9 * B)
                             for B in sizes]}
    out = reshard_overheads(two_cpus(), steps)
    assert out["all_to_allv"] == pytest.approx((20.0, 2.0), rel=1e-6)
    assert out["all_to_all"] == pytest.approx((90.0, 0.0), abs=1e-6)
    ranks = [{"rank": r, "host": "h", "model": "cpu", "memory": 8.0,
              "gflops": {"float32": 10.0}} for r in range(2)]
    cluster = build_cluster(ranks, {(0, 1): (BW, LAT)}, None, "calibrated2", steps)
    cluster.save(tmp_path / "c.yaml")
    device = dg.Cluster.from_file(tmp_path / "c.yaml").devices[0]
    B = 1 << 21
    ring = Ring(BW, LAT, True)
    assert op_collective_time("all_to_allv", 2, B, ring, device) == pytest.approx(
        collective_time("all_to_all", 2, B, BW, LAT) + 2e-5 + 2e-9 * B, rel=1e-6)
    older = Device(0, 0, 0, "CPU", reshard_overhead={"all_to_all": (90.0, 0.0)})
    assert software_time(older, "all_to_allv", B) == pytest.approx(9e-5, rel=1e-6)


def test_the_counts_exchange_fixes_the_per_step_cost_of_the_variable_all_to_all():
    """With the dispatch's counts (64 bytes) among the sizes, their time beyond the
    alpha-beta is the per-step cost, and the larger sizes give the per-byte cost beyond
    it, though a line through all four would lift the intercept (the software's cost
    per byte is not linear: 30 µs for the counts, a step to 50 µs at 256 KiB, then
    2 ns per byte more)."""
    counts = 64
    sizes = (1 << 18, 1 << 20, 1 << 22)
    model = [collective_time("all_to_all", 2, B, BW, LAT) for B in (counts,) + sizes]
    steps = {"all_to_allv": [(counts, model[0] + 3e-5)] +
             [(B, t + 5e-5 + 2e-9 * (B - sizes[0])) for B, t in zip(sizes, model[1:])]}
    per_step, per_byte = reshard_overheads(two_cpus(), steps)["all_to_allv"]
    assert per_step == pytest.approx(30.0, rel=1e-6)
    slope = [B - counts for B in sizes]
    beyond = [5e-5 + 2e-9 * (B - sizes[0]) - 3e-5 for B in sizes]
    fitted = sum(a * b for a, b in zip(slope, beyond)) / sum(a * a for a in slope) * 1e9
    assert per_byte == pytest.approx(round(fitted, 6), rel=1e-6) and per_byte > 0


def test_the_uneven_routing_sends_each_rank_its_buffer():
    from distgraph.tools.step_probe import uneven_counts

    counts = uneven_counts(4, 1000)
    assert (counts.sum(axis=1) == 1000).all() and len(set(counts[0].tolist())) > 1


def test_a_ring_round_is_microseconds_alone():
    """``ring_round`` has no cost per byte: a file or a Device that gives one is refused
    (not read and dropped)."""
    from distgraph.resources.elements import Device, InvalidCluster

    def one(overhead):
        return {"machines": [{"hostname": "a", "devices": [
            {"global_id": 0, "type": "CPU", "memory": 1, "gflops": {"float32": 10},
             "reshard_overhead": overhead}]}]}

    device = dg.Cluster.from_dict(one({"all_reduce": [30, 1], "ring_round": 12})).devices[0]
    assert device.reshard_overhead["ring_round"] == (12.0, 0.0)
    with pytest.raises(dg.errors.DistGraphError, match="ring_round"):
        dg.Cluster.from_dict(one({"all_reduce": [30, 1], "ring_round": [12, 3]}))
    with pytest.raises(InvalidCluster, match="ring_round"):
        Device(0, 0, 0, "CPU", reshard_overhead={"ring_round": (12.0, 3.0)})
