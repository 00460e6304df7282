"""Run a job on an emulated cluster: ``distgraph run -n N --emulate FILE script.py``.

Everything that can be checked is checked before anything is created: the resource
file, the rank count, the fault lines, root and the ``ip``/``tc``/``unshare`` tools.
Then :class:`~distgraph.runtime.emulate.Emulation` builds the namespaces and links, and
``mpiexec`` runs in the hub namespace with Hydra's ssh launcher pointed at
:mod:`distgraph.runtime.emulate_exec`, which starts each machine's proxy in that
machine's namespace under its hostname. The ranks get the usual launcher environment
(``rank_env``: one BLAS thread, the allocator settings, ``DISTGRAPH_CLUSTER`` = FILE so the
Engine plans for the cluster it runs on) plus the transport below.

Transport: the mpich wheel here is built with ch4:ofi and ch4:ucx. Its default (UCX)
uses shared memory between ranks whatever their namespace and hostname (measured 7.3 GB/s
across a link shaped to 1 Gbit/s), so the ranks get ``MPICH_CH4_NETMOD=ofi`` with
libfabric's ``tcp`` provider on the machine interface (``FI_PROVIDER=tcp``,
``FI_TCP_IFACE=dg0``): between machines MPI then goes over TCP through the shaped veth
(0.117 GB/s measured on that link), inside a machine over MPICH's own shared memory.

Example::

    rc = launch_emulated("resources/clusters/emulated_2x2.yaml", 4, ["train.py"],
                         faults=["link node0-node1 down at 5s"])
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from distgraph.errors import DistGraphError, PlanError
from distgraph.runtime.emulate import Emulation, Terminated, check_prerequisites, taken_subnets
from distgraph.runtime.emulate_exec import HOSTS_VAR
from distgraph.runtime.emulate_faults import FaultInjector, parse_fault
from distgraph.runtime.emulate_layout import choose_subnet, plan_layout, this_job

EXEC_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emulate_exec.py")
TRANSPORT_ENV = {"MPICH_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "dg0"}
STATUS_DIR = "DISTGRAPH_STATUS_DIR"
POLL_SECONDS = 0.2


def prepare(cluster_file: str, nprocs: int, faults=()):
    """(layout, parsed faults) for a job; raises DistGraphError before anything exists."""
    from distgraph.resources.cluster import Cluster

    cluster = Cluster.from_file(cluster_file)
    check_prerequisites()
    job = this_job()
    layout = plan_layout(cluster, nprocs, job, choose_subnet(job, taken_subnets()))
    hostnames = [m.hostname for m in layout.machines]
    return layout, [parse_fault(f, hostnames) for f in faults]


def mpiexec_command(layout, wrapper: str, argv: list[str]) -> list[str]:
    """The command that starts the job's ranks from the hub namespace."""
    from distgraph.runtime.launcher import mpiexec_path

    return ["ip", "netns", "exec", layout.hub_namespace, mpiexec_path(),
            "-launcher", "ssh", "-launcher-exec", wrapper, "-localhost", layout.hub_address,
            "-hosts", layout.hosts_argument(), "-n", str(len(layout.rank_machine)),
            sys.executable, "-m", "distgraph.runtime.bootstrap", *argv]


def _write_wrapper(folder: str) -> str:
    path = os.path.join(folder, "launcher-exec")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(EXEC_SCRIPT)} "
                '"$@"\n')
    os.chmod(path, 0o755)
    return path


def launch_emulated(cluster_file: str, nprocs: int, argv: list[str], faults=(),
                    env: dict | None = None, timeout: float | None = None, log=None) -> int:
    """Run ``argv`` (a script and its args) on ``nprocs`` ranks of the emulated
    ``cluster_file``; mpiexec's exit code (128 + signal when interrupted, 124 on
    ``timeout``). Whatever happens, the namespaces are gone when it returns."""
    from distgraph.runtime.launcher import failure_report, rank_env

    log = sys.stderr if log is None else log
    layout, parsed = prepare(cluster_file, nprocs, faults)
    proc = injector = None
    try:
        with tempfile.TemporaryDirectory(prefix="distgraph-emulate-") as tmp, \
                Emulation(layout, log) as emulation:
            log.write(layout.describe() + "\n")
            log.flush()
            status = os.path.join(tmp, "status")
            os.mkdir(status)
            ranks = rank_env(env, cluster_file)
            ranks.update(TRANSPORT_ENV)
            ranks[STATUS_DIR] = status
            ranks[HOSTS_VAR] = json.dumps(layout.host_map())
            proc = subprocess.Popen(mpiexec_command(layout, _write_wrapper(tmp), argv),
                                    env=ranks)
            injector = FaultInjector(emulation, parsed, log).start()
            rc = _wait(proc, timeout, injector, _comm_timeout(ranks), log)
            injector.stop()
            if rc != 0:
                log.write(failure_report(status, nprocs, rc) + "\n")
                if injector.report(layout):
                    log.write(f"distgraph: RuntimeFault: {injector.report(layout)}\n")
            if injector.error is not None:
                log.write(f"distgraph: could not inject a fault: {injector.error}\n")
                rc = rc or 1
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Terminated) else 2
        log.write(f"distgraph: interrupted by signal {signum}; the emulated cluster was "
                  "removed\n")
        rc = 128 + signum
    finally:
        if injector is not None:
            injector.stop()
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
    return rc


def _comm_timeout(env: dict) -> float:
    from distgraph.runtime.comm import DEFAULT_TIMEOUT

    try:
        return float(env.get("DISTGRAPH_COMM_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


def _wait(proc, timeout, injector, comm_timeout: float, log) -> int:
    """mpiexec's exit code; 124 past ``timeout``; 1 when the job outlives a lasting link
    fault by two communication timeouts (its ranks are blocked where distgraph's
    timeouts do not reach, e.g. in MPI_Init). The emulation's removal then ends it."""
    start = time.monotonic()
    while True:
        try:
            return proc.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        if timeout is not None and time.monotonic() - start > timeout:
            log.write(f"distgraph: the emulated job did not end within {timeout:g} s; "
                      "stopping it\n")
            return 124
        cut = injector.cut_since()
        if cut is not None and cut > 2 * comm_timeout:
            log.write(f"distgraph: the job is still running {cut:.0f} s after a lasting "
                      f"emulated fault (communication timeout {comm_timeout:g} s): its ranks "
                      "are blocked where distgraph's timeouts do not reach (e.g. MPI start-up)"
                      "; stopping it\n")
            return 1


def run_command(args) -> int:
    """``distgraph run --emulate FILE [--emulate-fault SPEC]...``: the CLI's handler."""
    if not args.emulate:
        print("distgraph run: --emulate-fault needs --emulate FILE", file=sys.stderr)
        return 2
    if args.cluster and os.path.abspath(args.cluster) != os.path.abspath(args.emulate):
        print(f"distgraph run: --cluster {args.cluster} and --emulate {args.emulate} name "
              "different files; the Engine plans for the emulated one, so give only "
              "--emulate", file=sys.stderr)
        return 2
    try:
        return launch_emulated(args.emulate, args.nprocs, [args.script, *args.args],
                               faults=args.emulate_fault)
    except (DistGraphError, PlanError) as err:
        print(f"distgraph run: {err}", file=sys.stderr)
        return 2
