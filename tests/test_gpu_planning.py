"""GPU clusters on a machine without a GPU: what the CPU can check of the GPU path.

The backend and each group's communicator are planned from the cluster (pure, checked
with GPU cluster descriptions); asking for GPUs where there are none fails before
anything runs, in one line; a GPU plan's communicator routes each group (MPI with host
staging where ranks share a GPU), which is checked with numpy standing in for CuPy: the
plans train like serial, and the bytes counted equal the plan's.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.errors import DistGraphError, PlanError  # noqa: E402
from distgraph.passes.mapping.devices import assign_devices  # noqa: E402
from distgraph.plan.devices import CUPY, MPI, NCCL, NUMPY, STAGED  # noqa: E402
from distgraph.resources.cluster import Cluster  # noqa: E402
from distgraph.resources.gpus import NoGPU, detect_gpus  # noqa: E402
from distgraph.runtime.backend import NUMPY as NUMPY_BACKEND  # noqa: E402
from distgraph.runtime.comm.device import DeviceCommunicator  # noqa: E402
from distgraph.runtime.comm.simulated import SimulatedWorld  # noqa: E402

import device_cases as D  # noqa: E402
import plans as P  # noqa: E402

CLUSTERS = os.path.join(os.path.dirname(dg.__file__), os.pardir, "resources", "clusters")


def has_gpu() -> bool:
    try:
        detect_gpus()
    except NoGPU:
        return False
    return True


# ---- the cluster ------------------------------------------------------------------------
@pytest.mark.skipif(has_gpu(), reason="this machine has a GPU (tests/test_gpu.py runs it)")
def test_asking_for_gpus_without_one_is_one_line_saying_which():
    with pytest.raises(NoGPU) as err:
        dg.Cluster.local(2, device="GPU")
    text = str(err.value)
    assert "\n" not in text and isinstance(err.value, DistGraphError)
    assert "Cluster.local(2, device='GPU')" in text
    assert ("needs CuPy, which is not installed" in text and "pip install" in text) or \
        "needs a CUDA GPU, but" in text


def test_local_devices_are_cpu_or_gpu():
    with pytest.raises(PlanError, match="'CPU' .* or 'GPU'"):
        dg.Cluster.local(2, device="TPU")
    assert {d.type for d in dg.Cluster.local(2).devices} == {"CPU"}


def test_ranks_on_one_gpu_share_its_local_id_and_memory(tmp_path):
    cluster = D.gpu_cluster(4, gpus=2, memory=80.0)
    assert [d.local_id for d in cluster.devices] == [0, 1, 0, 1]
    assert all(d.type == "GPU" and d.memory == 40.0 for d in cluster.devices)
    path = tmp_path / "two_gpus.yaml"
    cluster.save(path)
    again = Cluster.from_file(path)        # a file may say so too: one local id, shared
    assert [d.local_id for d in again.devices] == [0, 1, 0, 1]
    kinds = {(a.global_id, b.global_id): type_ for a, b, type_ in
             [(cluster.device(ln.source), cluster.device(ln.target), ln.type)
              for ln in cluster.machines[0].links]}
    assert kinds[(0, 2)] == "SHM" and kinds[(0, 1)] == "PCIe"


# ---- planning the backend and the communicators ------------------------------------------
def test_backend_follows_the_devices():
    assert assign_devices(None, 2).backend == NUMPY
    assert assign_devices(dg.Cluster.local(2), 2).backend == NUMPY
    assert assign_devices(D.gpu_cluster(2, 2), 2).backend == CUPY
    hetero = Cluster.from_file(os.path.join(CLUSTERS, "hetero_2gpu_2xpu.yaml"))
    types = [d.type for d in hetero.devices]
    mixed = assign_devices(hetero, len(types))
    assert set(types) == {"GPU", "XPU"}
    with pytest.raises(PlanError, match="GPU and XPU devices at once"):
        mixed.backend
    assert mixed.pretty().startswith("backend: none")


@pytest.mark.parametrize("ranks, gpus, routes", [
    (4, 1, {(0, 1): STAGED, (2, 3): STAGED, (0, 1, 2, 3): STAGED}),
    (4, 4, {(0, 1): NCCL, (3, 1): NCCL, (0, 1, 2, 3): NCCL}),
    # rank r on GPU r mod 2: 0 and 2 share GPU 0, 1 and 3 share GPU 1
    (4, 2, {(0, 1): NCCL, (2, 3): NCCL, (0, 2): STAGED, (1, 3): STAGED,
            (0, 1, 2, 3): STAGED}),
])
def test_groups_of_ranks_sharing_a_gpu_go_through_mpi_with_host_staging(ranks, gpus, routes):
    where = assign_devices(D.gpu_cluster(ranks, gpus), ranks)
    assert {g: where.route(g) for g in routes} == routes
    assert assign_devices(dg.Cluster.local(ranks), ranks).route((0, 1)) == MPI


def test_a_gpu_file_of_two_machines_routes_within_and_between_them():
    cluster = Cluster.from_file(os.path.join(CLUSTERS, "gpu_2x8.yaml"))
    where = assign_devices(cluster, 16)
    assert where.backend == CUPY and where.route((0, 8)) == NCCL      # across machines
    assert {where.device(r).local_id for r in range(8)} == set(range(8))


def _plan_on(kind, name, n, gpus, **strategy):
    plan, _, _ = D.planned(kind, name, n, D.gpu_cluster(n, gpus), **strategy)
    return plan


def test_explain_names_the_backend_and_each_mesh_dims_communicator():
    shared = _plan_on("gpt", "dp_tp", 4, 1).explain(full=True)
    assert "backend: cupy; GPU 0 of localhost: ranks 0, 1, 2, 3 (sharing it: MPI with " \
           "host staging between them)" in shared
    assert "mesh dim 'dp' of" in shared and "mesh dim 'mp' of" in shared
    assert f"{STAGED} for ranks" in shared and NCCL not in shared
    own = _plan_on("gpt", "dp_tp", 4, 4)
    text = own.explain(full=True)
    assert "backend: cupy; GPU 0 of localhost: rank 0; GPU 1 of localhost: rank 1" in text
    assert f"mesh dim 'dp' of ProcessMesh([[0, 1], [2, 3]], dims=[dp, mp]): {NCCL} for " \
           "ranks" in text and STAGED not in text
    assert own.to_dict()["placement"]["backend"] == CUPY
    pipeline = _plan_on("mlp", "two_stage", 2, 2, micro_batches=2).explain(full=True)
    assert f"point to point: {NCCL} for ranks (0, 1), (1, 0)" in pipeline
    cpu = D.planned("mlp", "dp", 2, dg.Cluster.local(2))[0].explain(full=True)
    assert "backend: numpy on CPU ranks" in cpu and f"{MPI} for ranks (0, 1)" in cpu


def _all_groups(plan):
    return {pid: plan.program_of(pid).comm_groups for pid in plan.process_ids}


@pytest.mark.parametrize("key", [("gpt", "dp_tp", 4), ("mlp", "two_stage", 4),
                                 ("gpt", "tp", 2), ("mlp", "zero", 4)], ids=str)
def test_every_member_of_a_group_makes_it_in_one_global_order(key):
    """The runtime makes the groups' NCCL communicators in CommGroup.key order on every
    rank; that cannot deadlock only if each group is made by all its members."""
    plan = _plan_on(*key, gpus=key[2], micro_batches=2)
    groups = _all_groups(plan)
    seen = {}
    for pid, mine in groups.items():
        assert [g.key for g in mine] == sorted(g.key for g in mine)
        rank = plan.ranks(pid)
        for g in mine:
            assert rank in g.ranks
            seen.setdefault(g.key, set()).add(rank)
    assert seen
    for key_, members in seen.items():
        assert members == set(key_[1]), key_
    assert any(not k[0] for k in seen)                # collectives: False sorts first
    if key[1] == "two_stage":         # stage 0 -> stage 1 messages, on the mapped ranks
        stage = {pid: s for s, mesh in enumerate(plan.stages) for pid in mesh.process_ids}
        assert any(k[0] and [stage[plan.ranks.process(r)] for r in k[1]] == [0, 1]
                   for k in seen), seen


# ---- running GPU plans: numpy standing in for CuPy --------------------------------------
_SERIAL: dict = {}


def serial(kind):
    if kind not in _SERIAL:
        _SERIAL[kind] = D.serial(kind)
    return _SERIAL[kind]


@pytest.mark.parametrize("case", D.CASES, ids=D.case_id)
def test_plans_on_one_shared_gpu_route_through_host_staging_and_equal_serial(case, float64):
    """Every group of ranks on one GPU goes through MPI with host staging (here the
    simulated world's threads): trained like serial, each byte counted as planned."""
    kind, name, n, opts = case
    plan, built, init = D.planned(kind, name, n, D.gpu_cluster(n, 1), **opts)
    reference = serial(kind)

    def body(comm):
        losses, params, runner = D.train(kind, plan, built, init, comm, NUMPY_BACKEND)
        assert isinstance(runner.comm, DeviceCommunicator)
        assert runner.comm.host is comm and runner.comm._nccl is None
        return (losses, params), dict(runner.comm.bytes_sent), dict(comm.bytes_sent)

    for result, counted, host_counted in SimulatedWorld(n, timeout=60).run(body):
        loss, param = D.largest_errors(result, reference)
        assert loss < 1e-10 and param < 1e-10
        assert sum(counted.values()) > 0 and sum(host_counted.values()) == 0


def test_gpu_plan_on_a_machine_without_gpus_fails_before_training_in_one_line():
    if has_gpu():
        pytest.skip("this machine has a GPU")
    model = P.build_model("mlp")
    engine = dg.Engine(model, P.loss_fn("mlp"), P.make_optimizer("adamw"),
                       cluster=D.gpu_cluster(1, 1))
    before = {n: p.numpy().copy() for n, p in model.named_parameters()}
    with pytest.raises(NoGPU) as err:
        engine.fit(P.Dataset("mlp"), batch_size=P.BATCH, epochs=1, verbose=0)
    assert "\n" not in str(err.value)
    assert str(err.value).startswith("rank 0 of this plan (on GPU 0 of localhost) needs ")
    assert engine.global_step == 0
    assert all(np.array_equal(p.numpy(), before[n]) for n, p in model.named_parameters())


DEVICE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts",
                             "device_plans.py")


def run_device_plans(nprocs, gpus, backend, keys, timeout=300):
    """The JSON report of tests/mpi_scripts/device_plans.py under ``distgraph run``."""
    import json
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs),
                           DEVICE_SCRIPT, str(gpus), backend, *keys], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("DEVICE-RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, keys", [(2, ["gpt:tp", "mlp:two_stage:1F1B"]),
                                          (4, ["gpt:dp_tp", "mlp:two_stage:1F1B"])])
def test_shared_gpu_plans_on_mpi_ranks_route_through_host_staging(nprocs, keys):
    report = run_device_plans(nprocs, 1, "numpy", keys)
    assert report["world"] == nprocs and sorted(report["cases"]) == sorted(keys)
    for key, ranks in report["cases"].items():
        for rank, mine in enumerate(ranks):
            assert mine["loss"] < 1e-10 and mine["param"] < 1e-10, (key, rank, mine)
            assert mine["routes"] == [STAGED] and mine["nccl"] == [], (key, rank)
            assert mine["losses"] == ranks[0]["losses"]
