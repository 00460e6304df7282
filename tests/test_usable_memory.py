"""A device's usable memory (resources/README.md, "Usable memory"): its memory less
``reserved_memory`` (the resource file's, else the default for its type), at most
``Strategy(memory_budget_gb)``. The file's key is read, checked and written back; every
limit the planner fits to is the usable memory, so a plan that fits the device's memory but
not its usable memory is searched again or refused."""

from __future__ import annotations

import json
import os
import sys

import pytest
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import DoesNotFit, PlanError  # noqa: E402
from distgraph.passes.cost.fit import limit_of  # noqa: E402
from distgraph.passes.mapping.process_graph import ProcessGraph  # noqa: E402
from distgraph.passes.mapping.rank_mapping import map_ranks  # noqa: E402
from distgraph.units import GB  # noqa: E402

from test_fitting import _annotated, _gpt, cluster_of, fits, searched  # noqa: E402


def one_machine(*devices, nics=()) -> dict:
    """A resource file's data: one machine of ``devices`` (dicts without global ids)."""
    return {"machines": [{"hostname": "h", "devices": [
        {"global_id": i, "gflops": {"float32": 100}, **d} for i, d in enumerate(devices)],
        "nics": [{"global_id": 100 + k, **n} for k, n in enumerate(nics)]}]}


def reserved(cluster, memory_gb: float, reserve_gb: float | None, kind: str = "CPU"):
    """``cluster`` with every device of ``memory_gb`` GB, of type ``kind``, reserving
    ``reserve_gb`` (None: the type's default)."""
    data = cluster.to_dict()
    for machine in data["machines"]:
        for d in machine["devices"]:
            d.update(memory=memory_gb, type=kind)
            d.pop("reserved_memory", None)
            if reserve_gb is not None:
                d["reserved_memory"] = reserve_gb
    return dg.Cluster.from_dict(data)


# ---- the resource file ----------------------------------------------------------------------

def test_the_default_reserve_per_device_type():
    """Accelerators keep 2 GB and 5% of their memory, at most half of it; a CPU and a NIC
    nothing; a file's figure, 0 included, is kept as given."""
    c = dg.Cluster.from_dict(one_machine(
        {"type": "GPU", "memory": 80}, {"type": "GPU", "memory": 40}, {"type": "XPU", "memory": 32},
        {"type": "NPU", "memory": 64}, {"type": "GPU", "memory": 2}, {"type": "CPU", "memory": 256},
        {"type": "GPU", "memory": 80, "reserved_memory": 20},
        {"type": "GPU", "memory": 80, "reserved_memory": 0},
        {"type": "CPU", "memory": 16, "reserved_memory": 4}, nics=[{"model": "cx6"}]))
    got = [(d.type, d.memory, d.reserve, d.usable_memory()) for d in c.devices]
    assert got == [("GPU", 80, 6, 74), ("GPU", 40, 4, 36), ("XPU", 32, 3.6, 28.4),
                   ("NPU", 64, 5.2, 58.8), ("GPU", 2, 1, 1), ("CPU", 256, 0, 256),
                   ("GPU", 80, 20, 60), ("GPU", 80, 0, 80), ("CPU", 16, 4, 12)]
    assert (c.nics[0].reserve, c.nics[0].usable_memory()) == (0, 0)
    # the budget lowers it, never raises it
    assert [c.devices[0].usable_memory(b) for b in (40, 100)] == [40, 74]
    assert limit_of(c, 0, None) == 74 * GB and limit_of(c, 6, 70) == 60 * GB


def test_the_key_is_written_back_only_where_the_file_gives_it(tmp_path):
    data = one_machine({"type": "GPU", "memory": 80, "reserved_memory": 12.5},
                       {"type": "GPU", "memory": 80})
    c = dg.Cluster.from_dict(data)
    for name in ("c.yaml", "c.json"):
        c.save(tmp_path / name)
        back = dg.Cluster.from_file(tmp_path / name)
        assert [d.reserved_memory for d in back.devices] == [12.5, None]
        assert [d.usable_memory() for d in back.devices] == [67.5, 74]
    written = yaml.safe_load((tmp_path / "c.yaml").read_text())["machines"][0]["devices"]
    assert written[0]["reserved_memory"] == 12.5 and "reserved_memory" not in written[1]


def test_node_groups_and_paddles_format_carry_the_reserve(tmp_path):
    group = {"node_groups": [{
        "count": 3, "hostname": "n{index:02d}", "id_step": 2,
        "devices": [{"global_id": 0, "type": "GPU", "model": "G", "memory": 80,
                     "reserved_memory": 10, "gflops": {"bfloat16": 1000}},
                    {"global_id": 1, "type": "GPU", "model": "G", "memory": 80,
                     "gflops": {"bfloat16": 1000}}],
        "links": [{"source": 0, "target": 1, "bandwidth": 300, "latency": 2}],
        "uplinks": [{"source": 0, "target": 100, "bandwidth": 25, "latency": 5}]}],
        "switches": [{"global_id": 100}]}
    path = tmp_path / "group.yaml"
    path.write_text(yaml.safe_dump(group))
    c = dg.Cluster.from_file(path)
    assert [d.usable_memory() for d in c.devices] == [70, 74] * 3
    paddle = {"machines": [{"hostname": "h", "devices": [
        {"global_id": 0, "local_id": 0, "type": "GPU", "model": "V100", "memory": "32",
         "sp_gflops": "15700", "reserved_memory": "8"},
        {"global_id": 1, "local_id": 1, "type": "GPU", "model": "V100", "memory": "32",
         "sp_gflops": "15700"}],
        "links": [{"source_global_id": 0, "target_global_id": 1, "bandwidth": 100}]}]}
    (tmp_path / "paddle.json").write_text(json.dumps(paddle))
    c = dg.Cluster.from_file(tmp_path / "paddle.json")
    assert [d.usable_memory() for d in c.devices] == [24, pytest.approx(28.4)]


def test_cluster_show_says_the_usable_memory():
    text = dg.Cluster.from_file(os.path.join(os.path.dirname(__file__), "..", "resources",
                                             "clusters", "gpu_2x8.yaml")).describe()
    assert "40 GB, 36 GB usable" in text
    assert "4 GB, " not in dg.Cluster.local(2).describe()       # a CPU: all of it usable


# ---- the planner fits the usable memory ------------------------------------------------------

@pytest.fixture(scope="module")
def free_peak() -> float:
    """The MLP's searched peak where memory is no limit."""
    return searched(cluster_of(4, 1e12)).estimate.peak_memory


def test_a_searched_plan_fits_the_usable_memory(free_peak):
    """Devices of 1.5 x the free plan's peak reserving 0.7 x: the free plan fits their
    memory, not their usable memory; the plan made is the one made on devices of 0.8 x
    with no reserve."""
    roomy = reserved(cluster_of(4, 1e12), 1.5 * free_peak / GB, 0.7 * free_peak / GB)
    assert roomy.devices[0].usable_memory() * GB == pytest.approx(0.8 * free_peak)
    plan = searched(roomy)
    assert plan.estimate.peak_memory <= 0.8 * free_peak * (1 + 1e-9) < free_peak
    assert fits(plan, roomy)
    same = searched(cluster_of(4, 0.8 * free_peak))
    assert (plan.estimate.peak_memory, plan.estimate.step_time) == \
        (same.estimate.peak_memory, same.estimate.step_time)
    # a GPU's default reserve: a device of 1.5 x keeps half of it (a few MB: at most half)
    gpus = reserved(cluster_of(4, 1e12), 1.5 * free_peak / GB, None, kind="GPU")
    assert gpus.devices[0].reserve == gpus.devices[0].memory / 2
    assert searched(gpus).estimate.peak_memory <= 0.75 * free_peak * (1 + 1e-9)


def test_a_stage_search_fits_the_usable_memory():
    """The pipeline's stages: on devices whose memory holds the free plan and whose usable
    memory does not, the plan made fits the usable memory, or none does."""
    strategy = dg.Strategy(auto_mode="full", pipeline=True, micro_batches=4,
                           sharding=False, sequence_parallel=False)
    free = dg.passes.plan(_gpt(), strategy, cluster_of(4, 1e12)).estimate.peak_memory
    cluster = reserved(cluster_of(4, 1e12), 1.5 * free / GB, 0.8 * free / GB)
    try:
        plan = dg.passes.plan(_gpt(), strategy, cluster)
    except DoesNotFit as e:
        assert e.limit == pytest.approx(0.7 * free) and (e.peak is None or e.peak > e.limit)
        return
    assert plan.estimate.peak_memory <= 0.7 * free * (1 + 1e-9) and fits(plan, cluster)


def test_an_annotated_plan_within_the_memory_but_over_the_usable_is_refused():
    plain = dg.passes.plan(*_annotated(False), cluster_of(2, 1e12)).estimate
    worst = max(plain.processes, key=lambda p: p.peak_memory)
    memory, reserve = 2 * worst.peak_memory / GB, 1.5 * worst.peak_memory / GB
    cluster = reserved(cluster_of(2, 1e12), memory, reserve)
    with pytest.raises(DoesNotFit) as refused:
        dg.passes.plan(*_annotated(False), cluster)
    assert refused.value.limit == pytest.approx(0.5 * worst.peak_memory)
    assert (f"which may hold {0.5 * worst.peak_memory / GB:.4g} GB (its {reserve:.4g} GB "
            "reserve left free)") in str(refused.value)
    dg.passes.plan(*_annotated(False), reserved(cluster_of(2, 1e12), memory, 0.0))   # fits


def test_rank_mapping_places_a_process_only_where_the_usable_memory_holds_it():
    """A process of 70 GB: a GPU of 80 GB keeps 6 (74 usable) and takes it; one of 80 GB
    reserving 20 does not."""
    data = one_machine({"type": "GPU", "model": "A100", "memory": 80, "reserved_memory": 20},
                       {"type": "GPU", "model": "A100", "memory": 80})
    c = dg.Cluster.from_dict(data)
    assert map_ranks(ProcessGraph(2, memory=[70, 1]), c).process_to_device == {0: 1, 1: 0}
    with pytest.raises(PlanError, match=r"only 1 of the 2 devices .* can hold one: device 0 "
                                        r"\(GPU A100, 80 GB, 60 GB usable\) has less memory "
                                        r"than the 70 GB the smallest process needs"):
        map_ranks(ProcessGraph(2, memory=[70, 70]), c)
