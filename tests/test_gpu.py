"""The GPU path on a machine with a GPU (``gpu`` marker; skipped, saying why, elsewhere).

- Serial training on CuPy equals serial training on numpy, fp64, to 1e-10 (GPT-tiny, with
  and without dropout, and the MLP, three AdamW steps: losses and parameters); the
  parameters live on the GPU, state_dict and checkpoints come back to the host.
- dp, tp, dp x tp and two stages of 1F1B on 2 and 4 ranks sharing the GPU (MPI with host
  staging) equal serial.
- Mixed precision (bf16) trains on CuPy as on numpy, to bfloat16's precision.
- NCCL on a one-rank group; with two GPUs or more, NCCL between 2 ranks (every
  collective, tag-matched messages, plans whose groups NCCL carries) and a rank that
  skips a collective ending its peer's wait within the timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
from distgraph.plan.devices import NCCL, STAGED  # noqa: E402
from distgraph.resources.gpus import NoGPU, detect_gpus  # noqa: E402

import plans as P  # noqa: E402
from test_gpu_planning import run_device_plans  # noqa: E402


def _gpus():
    try:
        return len(detect_gpus()), ""
    except NoGPU as e:
        return 0, str(e)


GPUS, WHY = _gpus()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason=f"no GPU: {WHY}")]
TOL = 1e-10
NCCL_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_scripts",
                           "nccl_checks.py")


def fit(kind, cluster, dropout=0.0):
    model = P.build_model(kind, dropout=dropout)
    engine = dg.Engine(model, P.loss_fn(kind), P.make_optimizer("adamw"), cluster=cluster)
    history = engine.fit(P.Dataset(kind), batch_size=P.BATCH, epochs=1, verbose=0)
    return engine, history.losses


@pytest.mark.parametrize("kind, dropout", [("mlp", 0.0), ("gpt", 0.0), ("gpt", 0.1)])
def test_serial_cupy_equals_serial_numpy(kind, dropout, float64, tmp_path):
    """With dropout too: the masks come from (seed, step) on the host, equal on both."""
    import cupy

    gpu_engine, gpu_losses = fit(kind, dg.Cluster.local(1, device="GPU"), dropout)
    cpu_engine, cpu_losses = fit(kind, None, dropout)
    runner = gpu_engine._plans.ran("train")
    assert runner.backend.name == "cupy"
    assert all(isinstance(a, cupy.ndarray) for a in gpu_engine._held.arrays.values())
    assert len(gpu_losses) == P.STEPS
    assert max(abs(a - b) for a, b in zip(gpu_losses, cpu_losses)) < TOL
    gpu_params, cpu_params = gpu_engine.state_dict(), cpu_engine.state_dict()
    assert all(isinstance(a, np.ndarray) for a in gpu_params.values())
    assert max(float(np.max(np.abs(gpu_params[k] - cpu_params[k]))) for k in cpu_params) < TOL
    gpu_engine.save(tmp_path / "ckpt")            # written from the GPU, read on numpy
    again = dg.Engine(P.build_model(kind, seed=5), P.loss_fn(kind), P.make_optimizer("adamw"))
    again.load(tmp_path / "ckpt")
    loaded = again.state_dict()
    assert all(np.array_equal(loaded[k], gpu_params[k]) for k in gpu_params)


def test_amp_on_cupy_trains_as_on_numpy():
    """``Strategy(amp="bfloat16")``: the GPU multiplies 16-bit operands on its matrix units
    (float32 accumulation), the host widens them to float32 first; both round each
    product once to bfloat16, so the losses agree to bfloat16's precision."""
    def losses(cluster):
        engine = dg.Engine(P.build_model("gpt"), P.loss_fn("gpt"), P.make_optimizer("adamw"),
                           cluster=cluster, strategy=dg.Strategy(amp="bfloat16"))
        return engine.fit(P.Dataset("gpt"), batch_size=P.BATCH, epochs=1, verbose=0).losses

    gpu, cpu = losses(dg.Cluster.local(1, device="GPU")), losses(dg.Cluster.local(1))
    assert len(gpu) == len(cpu) == P.STEPS
    assert np.allclose(gpu, cpu, rtol=1e-2), (gpu, cpu)


CASES = ["mlp:dp", "gpt:tp", "mlp:two_stage:1F1B", "gpt:two_stage:1F1B"]
FOUR = ["gpt:dp", "mlp:dp_tp", "gpt:dp_tp", "gpt:two_stage:1F1B"]


@pytest.mark.mpi
@pytest.mark.parametrize("nprocs, keys", [(2, CASES), (4, FOUR)])
def test_ranks_sharing_the_gpu_equal_serial(nprocs, keys):
    report = run_device_plans(nprocs, 1, "plan", keys, timeout=600)
    for key, ranks in report["cases"].items():
        for rank, mine in enumerate(ranks):
            assert mine["backend"] == "cupy", key
            assert mine["loss"] < TOL and mine["param"] < TOL, (key, rank, mine)
            assert mine["routes"] == [STAGED] and mine["nccl"] == [], (key, rank)


def run_nccl_checks(nprocs, *args, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1", DISTGRAPH_COMM_TIMEOUT="10")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", str(nprocs),
                           NCCL_SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("NCCL-RESULT ")]
    assert len(lines) == 1, proc.stdout[-3000:]
    return json.loads(lines[0].split(" ", 1)[1])


@pytest.mark.mpi
def test_nccl_on_a_one_rank_group():
    (mine,) = run_nccl_checks(1)
    assert mine["groups"] == ["collective:[0]"]
    assert len(mine["errors"]) == 7 and max(mine["errors"].values()) < 1e-12


needs_two = pytest.mark.skipif(GPUS < 2, reason=f"{GPUS} GPU: NCCL between ranks needs two")


@pytest.mark.mpi
@needs_two
def test_nccl_between_two_ranks():
    report = run_nccl_checks(2)
    for rank, mine in enumerate(report):
        assert "collective:[0, 1]" in mine["groups"] and "p2p:[0, 1]" in mine["groups"]
        assert len(mine["errors"]) == 10 and max(mine["errors"].values()) < 1e-12, mine


@pytest.mark.mpi
@needs_two
def test_a_rank_that_skips_a_collective_ends_its_peers_nccl_wait():
    rank0, rank1 = run_nccl_checks(2, "hang")
    assert rank0["errors"]["hang"].startswith("rank 0: timed out after 10 s waiting for "
                                              "NCCL all_reduce on ranks (0, 1)")
    assert rank1["errors"]["hang"] == "no timeout"


@pytest.mark.mpi
@needs_two
def test_plans_over_nccl_equal_serial():
    report = run_device_plans(2, "detect", "plan", CASES, timeout=600)
    for key, ranks in report["cases"].items():
        for rank, mine in enumerate(ranks):
            assert mine["loss"] < TOL and mine["param"] < TOL, (key, rank, mine)
            assert mine["routes"] == [NCCL] and mine["nccl"], (key, rank)


def test_the_bandwidth_probe_reads_what_one_large_add_streams_and_holds_to_10_percent():
    """The probe's GB/s against one add of three 1 GiB arrays timed by CUDA events (the
    fastest of five: a kernel of hundreds of microseconds, beside which the launch is
    nothing), and two probes in a row against each other: both within 10% (issue #65;
    the probe used to time chunks of 16 MB, about as long as their launch)."""
    import cupy

    from distgraph.runtime.backend import get_backend
    from distgraph.tools.device_probe import memory_bandwidth_gbps

    xb = get_backend("cupy")
    probes = [memory_bandwidth_gbps(3, xb, 256 * 2**20) for _ in range(2)]
    n = 2**30 // 8
    a, b, c = cupy.ones(n), cupy.ones(n), cupy.empty(n)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    best = np.inf
    for _ in range(5):
        start.record()
        cupy.add(a, b, out=c)
        end.record()
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
    streamed = 3 * n * 8 / best / 1e9
    assert probes[0] == pytest.approx(streamed, rel=0.10), (probes, streamed)
    assert probes[1] == pytest.approx(probes[0], rel=0.10), probes


@pytest.mark.mpi
def test_calibrate_measures_the_gpu(tmp_path):
    from distgraph.cli import main as cli

    out = tmp_path / "gpu.yaml"
    assert cli(["cluster", "calibrate", "-n", "1", "-o", str(out), "--repeats", "1",
                "--timeout", "300"]) == 0
    (device,) = dg.Cluster.from_file(out).devices
    assert device.type == "GPU" and device.local_id == 0
    assert device.model == detect_gpus()[0].name
    assert set(device.gflops) == {"float16", "bfloat16", "float32", "float64"}
    assert device.gflops["float32"] > 1000          # GFLOP/s: a GPU, not a core
    assert device.memory_bandwidth > 100 and device.gemm is not None
    assert not device.op_costs          # the roofline prices a GPU's ops (calibrate.py)
