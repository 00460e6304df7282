# Sourced: a venv at /tmp/dg-venv that sees the system's python3 packages (PyTorch, CuPy),
# with the wheels of folder $1 (what the machine lacks: pyscipopt, mpi4py, mpich, ...) and
# this checkout installed without the network; sets PY to its python.
#
#     . bench/gpu_env.sh .whl && "$PY" bench/gpu_profile.py
VENV=/tmp/dg-venv
python3 -m venv "$VENV"
# python3 may itself be a venv's (PyTorch's): the new one sees its packages through a .pth
python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
  >"$("$VENV/bin/python" -c 'import site; print(site.getsitepackages()[0])')/base.pth"
if [ -n "${1:-}" ]; then
  "$VENV/bin/pip" install -q --no-index --no-deps "$1"/*.whl
fi
"$VENV/bin/pip" install -q --no-index --no-deps --no-build-isolation -e .
PY="$VENV/bin/python"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
