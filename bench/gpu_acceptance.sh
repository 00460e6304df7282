#!/usr/bin/env bash
# The GPU acceptance, on a machine with one CUDA GPU and no network, in one run:
#
#     bench/gpu_acceptance.sh OUTDIR [WHEELS]
#
# WHEELS: a folder of wheels for what the machine lacks (pyscipopt, mpi4py, mpich, ...),
# installed with --no-index into a venv that sees the system's packages (its PyTorch, CuPy).
# Each step has its own time limit and writes its log to OUTDIR; a failing step does not
# stop the next. Steps, in order:
#   tests.log    the gpu tests: every op's kernel on CuPy against numpy (fp64, forward and
#                gradient), serial training on CuPy against numpy, plans on ranks sharing
#                the GPU (MPI with host staging), NCCL on a one-rank group, the calibration
#   step.log     bench/gpu_step.py: GPT-2 small's step against PyTorch eager, fp32 and bf16;
#                predicted step and peak, the runtime's count and CuPy's pool
#   calib.log    distgraph cluster calibrate on the GPU against the shipped H100 figures,
#                then the fp32 and amp steps again planned on that calibration (their
#                predictions), and two shapes it was not fitted to (24 layers of 1,024;
#                seq 256): whether the calibration holds
# summary.txt holds each step's exit status and seconds.
set -u
OUT=${1:?usage: bench/gpu_acceptance.sh OUTDIR [WHEELS]}
WHEELS=${2:-}
mkdir -p "$OUT"
HERE=$(cd "$(dirname "$0")/.." && pwd)
cd "$HERE"

step() {   # step NAME LIMIT COMMAND...: run with a time limit, log, record status and seconds
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >>"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc, $((SECONDS - start)) s: $*" | tee -a "$OUT/summary.txt"
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 -V; python3 -c "import cupy, numpy; print('cupy', cupy.__version__, 'numpy', numpy.__version__)"
} >"$OUT/setup.log" 2>&1

. bench/gpu_env.sh "$WHEELS" >>"$OUT/setup.log" 2>&1

# timings first, on an idle GPU
step step 150 "$PY" bench/gpu_step.py --steps 5 --numpy-steps 0
step step 120 "$PY" bench/gpu_step.py --steps 5 --numpy-steps 0 --amp
step calib 120 "$PY" -m distgraph.cli cluster calibrate -n 1 -o "$OUT/gpu.yaml" --repeats 3 --timeout 100
step calib 30 "$PY" - "$OUT/gpu.yaml" <<'EOF'
import sys
import distgraph as dg
from distgraph.resources.cluster import Cluster
(mine,) = Cluster.from_file(sys.argv[1]).devices
shipped = Cluster.from_file("resources/clusters/h100_16384.yaml").devices[0]
for name in ("model", "gflops", "memory_bandwidth", "op_overhead", "gemm"):
    print(f"{name:17} measured {getattr(mine, name)!r}\n{'':17} shipped  {getattr(shipped, name)!r}")
EOF
for shape in "" "--amp" "--layers 24 --d-model 1024 --heads 16 --batch 4" "--seq 256 --batch 4"; do
  # shellcheck disable=SC2086  (the shape's words are the bench's arguments)
  step step 120 "$PY" bench/gpu_step.py --steps 5 --numpy-steps 0 --cluster "$OUT/gpu.yaml" $shape
done
# the bandwidth probe's test alone: beside the other tests' kernels it reads their share
step tests 60 "$PY" -m pytest -p no:cacheprovider -q -rs tests/test_gpu.py -k bandwidth_probe
step tests 240 "$PY" -m pytest -p no:cacheprovider -q -rs -n 8 --durations=10 \
  -k "not bandwidth_probe" \
  tests/test_gpu_ops.py tests/test_gpu.py tests/test_gpu_planning.py tests/test_cupy_namespace.py
cat "$OUT/summary.txt"
