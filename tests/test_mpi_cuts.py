"""The bytes MPI puts on the link between two emulated machines are the cost model's
(root only; :func:`~distgraph.passes.cost.formulas.mpi_cut`): each machine's network
counter, read around one collective of the CPU runtime on 4 ranks of the emulated 2 x 2
cluster, against what the cost model prices on the ring's slowest hop (the ring's bytes
scaled by the group's :class:`~distgraph.passes.cost.formulas.Cuts`), where the ring's
own count is a quarter under or half over."""

import json

import pytest

from distgraph.passes.cost.formulas import mpi_cut, mpi_cuts, ring_cut
from test_emulate import BOUND, FILE_2X2, REASON, ROOT, Launcher

SCRIPT = str(ROOT / "tests" / "mpi_scripts" / "wire_bytes.py")
MiB = 2**20
# (kind, B): Rabenseifner's all-reduce, pairwise reduce-scatter, the all-gather's ring
# (long) and recursive doubling (short)
CASES = (("all_reduce", 4 * MiB), ("reduce_scatter", 4 * MiB), ("all_gather", 4 * MiB),
         ("all_gather", 256 * 1024))
# TCP/IP headers on 1,500-byte frames, the acknowledgements of what comes back
HEADERS = 1.05

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(REASON is not None,
                                                  reason=f"emulated clusters: {REASON}")]


@pytest.fixture(scope="module")
def counted():
    launcher = Launcher()
    try:
        result = launcher.run("run", "-n", "4", "--emulate", FILE_2X2, SCRIPT,
                              *(f"{k}:{b}" for k, b in CASES), timeout=BOUND)
    finally:
        left = launcher.cleanup()
    assert left == [], f"the job left namespaces behind: {left}"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    line = next(ln for ln in result.stdout.splitlines() if ln.startswith("WIRE-BYTES "))
    return json.loads(line.split(" ", 1)[1])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_machine_sends_the_bytes_the_cost_model_prices(counted, case):
    hosts = counted["hosts"]
    machines = tuple(sorted(set(hosts)).index(h) for h in hosts)
    assert machines == (0, 0, 1, 1)
    got = counted["cases"][case]
    kind, nbytes = CASES[case]
    assert (got["kind"], got["bytes"]) == (kind, nbytes)
    priced = ring_cut(kind, machines, nbytes) * mpi_cuts(machines).ratio(kind, nbytes)
    assert priced == pytest.approx(mpi_cut(kind, machines, nbytes))
    ring = ring_cut(kind, machines, nbytes)
    for host, sent in got["sent"].items():
        assert priced <= sent <= priced * HEADERS, (host, kind, nbytes, sent, priced, ring)
    if ring != priced:              # the ring's count is outside what was sent
        assert not ring <= min(got["sent"].values()) <= ring * HEADERS
