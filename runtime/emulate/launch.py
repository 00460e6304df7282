"""Run a job on an emulated cluster: ``distgraph run -n N --emulate FILE script.py``.

Everything that can be checked is checked before anything is created: the resource
file, the rank count, the fault lines, root, the ``ip``/``tc``/``unshare`` tools, and,
where the file's machines differ in speed, a cgroup cpu controller.
Then :class:`~distgraph.runtime.emulate.namespaces.Emulation` builds the namespaces and links, and
``mpiexec`` runs in the hub namespace with Hydra's ssh launcher pointed at
:mod:`distgraph.runtime.emulate.exec`, which starts each machine's proxy in that
machine's namespace under its hostname (and, where machines differ in speed, in the
machine's CPU-quota cgroup). The ranks get the usual launcher environment
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
import sys
import tempfile

from distgraph.errors import DistGraphError, PlanError
from distgraph.resources.cluster import Cluster
from distgraph.runtime.comm.base import DEFAULT_TIMEOUT
from distgraph.runtime.emulate.cgroups import require_controller
from distgraph.runtime.emulate.exec import GROUPS_VAR, HOSTS_VAR
from distgraph.runtime.emulate.faults import FaultInjector, parse_fault
from distgraph.runtime.emulate.layout import choose_subnet, emulated_job, this_job
from distgraph.runtime.emulate.namespaces import (
    TERMINATING,
    Emulation,
    Terminated,
    check_prerequisites,
    folder_prefix,
    taken_subnets,
)
from distgraph.runtime.launch.launcher import launch

EXEC_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exec.py")
TRANSPORT_ENV = {"MPICH_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "dg0"}


def prepare(cluster_file: str, nprocs: int, faults=()):
    """(layout, parsed faults) for a job; raises DistGraphError before anything exists."""

    cluster = Cluster.from_file(cluster_file)
    check_prerequisites()
    job = this_job()
    layout = emulated_job(cluster, nprocs, job, choose_subnet(job, taken_subnets()))
    if layout.throttled:
        require_controller()
    hostnames = [m.hostname for m in layout.machines]
    return layout, [parse_fault(f, hostnames) for f in faults]


def hydra_args(layout, wrapper: str) -> list[str]:
    """mpiexec options that start each machine's proxy through ``wrapper`` (Hydra's ssh
    launcher) at the machines' addresses, from the hub namespace's address."""
    return ["-launcher", "ssh", "-launcher-exec", wrapper, "-localhost", layout.hub_address,
            "-hosts", layout.hosts_argument()]


def _write_wrapper(folder: str) -> str:
    path = os.path.join(folder, "launcher-exec")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(EXEC_SCRIPT)} "
                '"$@"\n')
    os.chmod(path, 0o755)
    return path


def launch_emulated(cluster_file: str, nprocs: int, argv: list[str], faults=(),
                    env: dict | None = None, timeout: float | None = None, log=None,
                    log_dir: str | None = None) -> int:
    """Run ``argv`` (a script and its args) on ``nprocs`` ranks of the emulated
    ``cluster_file`` through :func:`distgraph.runtime.launch.launcher.launch` (signals, per-rank
    logs and failure reports as for any job); its exit code. Whatever happens, the
    namespaces are gone when it returns."""

    log = sys.stderr if log is None else log
    layout, parsed = prepare(cluster_file, nprocs, faults)
    comm_timeout = _comm_timeout(os.environ if env is None else env)
    injector = None
    try:
        with tempfile.TemporaryDirectory(prefix=folder_prefix("emulate", layout.job)) as tmp, \
                Emulation(layout, log) as emulation:
            log.write(layout.describe() + "\n")
            log.flush()
            injector = FaultInjector(emulation, parsed, log).start()

            def watch():
                # ranks blocked where distgraph's timeouts do not reach (MPI start-up)
                cut = injector.cut_since()
                if cut is not None and cut > 2 * comm_timeout:
                    return (f"the job was still running {cut:.0f} s after a lasting emulated "
                            f"fault (communication timeout {comm_timeout:g} s)")
                return None

            rc = launch(nprocs, argv, cluster=cluster_file, env=env, timeout=timeout,
                        log_dir=log_dir, mpiexec_args=hydra_args(layout, _write_wrapper(tmp)),
                        prefix=("ip", "netns", "exec", layout.hub_namespace),
                        extra_env={**TRANSPORT_ENV, HOSTS_VAR: json.dumps(layout.host_map()),
                                   GROUPS_VAR: json.dumps(emulation.procs_files())},
                        watch=watch)
            injector.stop()
            if rc != 0 and injector.report(layout):
                log.write(f"distgraph: RuntimeFault: {injector.report(layout)}\n")
            if injector.error is not None:
                log.write(f"distgraph: could not inject a fault: {injector.error}\n")
                rc = rc or 1
    except KeyboardInterrupt as exc:         # a signal while the cluster was being built
        signum = exc.signum if isinstance(exc, Terminated) else 2
        log.write(f"distgraph: interrupted by signal {signum}; the emulated cluster was "
                  "removed\n")
        rc = 128 + signum
    else:
        if rc - 128 in TERMINATING:   # launch() stopped the job on a signal; the cluster is gone now
            log.write(f"distgraph: stopped by signal {rc - 128}; the emulated cluster was "
                      "removed\n")
    finally:
        if injector is not None:
            injector.stop()
    return rc


def _comm_timeout(env: dict) -> float:

    try:
        return float(env.get("DISTGRAPH_COMM_TIMEOUT", DEFAULT_TIMEOUT))
    except ValueError:
        return DEFAULT_TIMEOUT


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
                               faults=args.emulate_fault, log_dir=args.log_dir)
    except (DistGraphError, PlanError) as err:
        print(f"distgraph run: {err}", file=sys.stderr)
        return 2
