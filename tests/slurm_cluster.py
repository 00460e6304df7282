"""A real Slurm on one box, for the tests: Debian's ``slurmctld``, ``slurmd`` and ``munged``
with a controller and two compute nodes, each a host in network namespaces of its own.

The hosts are a resource file's machines as :class:`~distgraph.runtime.emulate.namespaces.
Emulation` makes them (a namespace per machine, veth links through the hub's bridge). Per
compute node, a UTS and a mount namespace give it its hostname, an ``/etc/hosts`` naming
every host, and a ``/tmp`` of its own (a folder of this run), as on separate machines; in
it runs ``slurmd -D``. The controller, ``slurmctld -D``, runs on the launching host
("login", the hub, under a hostname of its own with the same ``/etc/hosts``), and the
user's commands (``sbatch``, ``salloc``, ``srun``, ``scancel``, ``scontrol``) run there
through :meth:`SlurmCluster.login_argv`. One ``munged`` with a key made for this run
authenticates them all (every host shares this box's files, as with a shared file
system; the munge socket is a file of the run's folder).

Slurm's configuration, which works in namespaces without systemd or cgroups:
``proctrack/linuxproc`` (a step's processes are its tasks' descendants, found through
``/proc``), ``task/none``, ``jobacct_gather/none``, no accounting storage, and
``select/cons_tres`` over CPUs, and ``CgroupPlugin=cgroup/v1`` in ``cgroup.conf``
(:data:`CGROUP_CONF`); nodes of 2 CPUs. Everything (``slurm.conf``, the munge
key and socket, state, spool, logs, the nodes' ``/tmp``) is under one temporary folder,
shown on every host at the same path (``shared`` is the place for what a job reads and
writes on every node, like a home directory on NFS); leaving the context kills every
process in the namespaces (the daemons, what jobs left), removes the namespaces and the
folder, also after an error.

Example (as root, with Debian's slurmd, slurmctld, slurm-client and munge installed)::

    with SlurmCluster() as slurm:
        subprocess.run(slurm.login_argv(["sbatch", "-N", "2", "--wait", "job.sh"]),
                       env={**os.environ, **slurm.env()})
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from distgraph.errors import PlanError, RuntimeFault
from distgraph.resources.cluster import Cluster
from distgraph.runtime.emulate.launch import TRANSPORT_ENV
from distgraph.runtime.emulate.layout import choose_subnet, emulated_job, this_job
from distgraph.runtime.emulate.namespaces import (Emulation, check_prerequisites,
                                                  namespace_pids, run_tool, taken_subnets)

ROOT = Path(__file__).resolve().parent.parent
TWO_NODES = ROOT / "resources" / "clusters" / "emulated_2x2.yaml"
PACKAGES = {"/usr/sbin/slurmctld": "slurmctld", "/usr/sbin/slurmd": "slurmd",
            "/usr/bin/sbatch": "slurm-client", "/usr/sbin/munged": "munge"}
LOGIN = "login"
CPUS = 2                    # per node
READY_SECONDS = 60
# Run in a host's fresh UTS and mount namespaces: its name, its /etc/hosts, the mounts
# ("$4"... source/target pairs inside its /tmp folder), then that folder as /tmp; then
# the daemon ("$@" after "--").
HOST_SETUP = ('hostname "$1" && mount --bind "$2" /etc/hosts && tmp="$3" && shift 3 && '
              'while [ "$1" != -- ]; do mount --bind "$1" "$2" && shift 2 || exit 1; done && '
              'shift && mount --rbind "$tmp" /tmp && exec "$@"')
LOGIN_SETUP = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
SLURM_CONF = """\
ClusterName=distgraph
SlurmctldHost={login}({login_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={folder}/munge/munge.socket
StateSaveLocation={folder}/ctld/state
SlurmctldPidFile={folder}/ctld/slurmctld.pid
SlurmctldLogFile={folder}/ctld/slurmctld.log
SlurmdSpoolDir={folder}/nodes/%n/spool
SlurmdPidFile={folder}/nodes/%n/slurmd.pid
SlurmdLogFile={folder}/nodes/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=20
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
MailProg=/bin/true
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
# slurmd 22.05 initialises a cgroup plugin even when no plugin of slurm.conf uses one:
# cgroup/v1 named here starts without a cgroup file system (``ip netns exec`` mounts a
# fresh /sys, without this box's), where autodetection fails.
CGROUP_CONF = "CgroupPlugin=cgroup/v1\n"
NODE_LINE = "NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN"


def missing_packages() -> list[str]:
    """The Debian packages whose programs the cluster runs that are not installed."""
    return sorted({pkg for path, pkg in PACKAGES.items() if not os.path.exists(path)})


class SlurmCluster:
    """The controller and ``cluster``'s machines as Slurm nodes (module docstring)."""

    def __init__(self, cluster_file=TWO_NODES, log=None):
        self.cluster = Cluster.from_file(str(cluster_file))
        self.log = sys.stderr if log is None else log
        self.layout = None
        self.folder = None
        self._emulation = None
        self._daemons: dict[str, subprocess.Popen] = {}

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        check_prerequisites()
        if missing_packages():
            raise PlanError(f"a Slurm cluster needs {', '.join(missing_packages())}; "
                            "install them (apt-get install slurmd slurmctld slurm-client "
                            "munge)")
        job = this_job()
        self.layout = emulated_job(self.cluster, len(self.cluster.devices), job,
                                   choose_subnet(job, taken_subnets()))
        self._emulation = Emulation(self.layout, self.log)
        self._emulation.__enter__()
        try:
            self.folder = tempfile.mkdtemp(prefix="distgraph-slurm-")
            self._write_files()
            self._start_munge()
            self._daemons["slurmctld"] = self._on_login(
                ["/usr/sbin/slurmctld", "-D", "-i"], "ctld/stdout.log")
            for name in self.nodes:
                self._start_slurmd(name)
            self.wait_idle()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._emulation.__exit__()      # kills every process in the namespaces
        finally:
            for daemon in self._daemons.values():
                try:
                    daemon.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
            self._daemons = {}
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)

    # ---- what tests use --------------------------------------------------------------
    @property
    def nodes(self) -> list[str]:
        return [m.hostname for m in self.layout.machines]

    @property
    def shared(self) -> str:
        """A folder at the same path on every host (for scripts, checkpoints, outputs)."""
        return self._path("shared")

    def env(self) -> dict:
        """What a user's environment holds on this cluster: Slurm's configuration file,
        and MPI over TCP on the hosts' interface (as a site sets it)."""
        return {"SLURM_CONF": self._path("slurm.conf"), **TRANSPORT_ENV}

    def login_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run on the login host (where users type sbatch and salloc)."""
        return ["ip", "netns", "exec", self.layout.hub_namespace, "unshare", "--uts",
                "--mount", "sh", "-c", LOGIN_SETUP, "login-setup", LOGIN,
                self._path("etc_hosts"), *argv]

    def slurm(self, *argv, timeout=60, check=True) -> subprocess.CompletedProcess:
        """A Slurm command (``scontrol``, ``squeue``...) on the login host."""
        proc = subprocess.run(self.login_argv([str(a) for a in argv]), capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, **self.env()})
        if check and proc.returncode != 0:
            raise RuntimeFault(f"`{' '.join(map(str, argv))}` failed: {proc.stderr.strip()}")
        return proc

    @property
    def daemon_pids(self) -> list[int]:
        """The process ids of munged, slurmctld and the nodes' slurmd."""
        return [d.pid for d in self._daemons.values()]

    def tmp_of(self, node: str) -> str:
        """The folder that is ``/tmp`` on ``node``."""
        return self._path("nodes", node, "tmp")

    def processes(self, node: str) -> list[str]:
        """The command lines of the processes on ``node`` other than its slurmd."""
        namespace = self.layout.machine(node).namespace
        daemon = self._daemons[node].pid
        found = []
        for pid in sorted(namespace_pids(namespace)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            if pid != daemon and cmdline:
                found.append(f"{pid} {cmdline}")
        return found

    def node_state(self, node: str) -> str:
        """The node's state as ``sinfo`` says it (``idle``, ``alloc``, ``drng``...)."""
        return self.slurm("sinfo", "-h", "-N", "-n", node, "-o", "%t").stdout.strip()

    def wait_idle(self, nodes=None, seconds=READY_SECONDS) -> None:
        """Until every node (of ``nodes``) is idle: registered, and free of jobs."""
        deadline = time.monotonic() + seconds
        waiting = list(nodes or self.nodes)
        while waiting:
            for name, daemon in self._daemons.items():
                if daemon.poll() is not None:
                    raise RuntimeFault(f"{name} ended: {self._said(name)}")
            proc = self.slurm("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=20)
            states = dict(ln.split() for ln in proc.stdout.splitlines() if ln.strip())
            waiting = [n for n in waiting if states.get(n) != "idle"]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise RuntimeFault(f"Slurm nodes not idle within {seconds} s: {states} "
                                   f"({proc.stderr.strip()}); slurmctld said: "
                                   f"{self._said('slurmctld')}")
            time.sleep(0.3)

    def resume(self, node: str) -> None:
        """A drained node back into service."""
        self.slurm("scontrol", "update", f"nodename={node}", "state=resume")
        self.wait_idle([node])

    # ---- making it -------------------------------------------------------------------
    def _path(self, *parts) -> str:
        return os.path.join(self.folder, *parts)

    def _write_files(self) -> None:
        names = {LOGIN: self.layout.hub_address}
        names.update({m.hostname: m.address for m in self.layout.machines})
        _write(self._path("etc_hosts"), "127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for name, address in names.items()))
        for part in ("munge", "ctld/state", "shared"):
            os.makedirs(self._path(part))
        os.chmod(self._path("shared"), 0o1777)
        for m in self.layout.machines:
            os.makedirs(self._path("nodes", m.hostname, "spool"))
            os.makedirs(self.tmp_of(m.hostname), mode=0o1777)
            os.chmod(self.tmp_of(m.hostname), 0o1777)
        nodes = "\n".join(NODE_LINE.format(name=m.hostname, address=m.address, cpus=CPUS)
                          for m in self.layout.machines)
        _write(self._path("slurm.conf"), SLURM_CONF.format(
            login=LOGIN, login_address=self.layout.hub_address, folder=self.folder,
            nodes=nodes))
        _write(self._path("cgroup.conf"), CGROUP_CONF)
        run_tool(["mungekey", "--create", "--keyfile", self._path("munge", "munge.key")],
                 "make the munge key")
        os.chmod(self._path("munge", "munge.key"), 0o400)

    def _start_munge(self) -> None:
        munge = self._path("munge")
        self._daemons["munged"] = self._on_login(
            ["/usr/sbin/munged", "--foreground", "--force",
             f"--key-file={munge}/munge.key", f"--socket={munge}/munge.socket",
             f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log",
             f"--seed-file={munge}/munged.seed"], "munge/stdout.log")
        deadline = time.monotonic() + READY_SECONDS
        while not os.path.exists(f"{munge}/munge.socket"):
            if self._daemons["munged"].poll() is not None or time.monotonic() > deadline:
                raise RuntimeFault(f"munged did not start: {self._said('munged')}")
            time.sleep(0.05)

    def _on_login(self, argv, log: str) -> subprocess.Popen:
        with open(self._path(log), "w") as out:
            return subprocess.Popen(self.login_argv(argv), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **self.env()})

    def _start_slurmd(self, name: str) -> None:
        m = self.layout.machine(name)
        tmp = self.tmp_of(name)
        pairs = []
        for top in _tops_in_tmp([self.folder, *_job_places()]):
            os.makedirs(os.path.join(tmp, top), exist_ok=True)
            pairs.append((os.path.join("/tmp", top), os.path.join(tmp, top)))
        mounts = [p for pair in pairs for p in pair]
        with open(self._path("nodes", name, "stdout.log"), "w") as out:
            self._daemons[name] = subprocess.Popen(
                ["ip", "netns", "exec", m.namespace, "unshare", "--uts", "--mount", "sh",
                 "-c", HOST_SETUP, "host-setup", name, self._path("etc_hosts"), tmp, *mounts,
                 "--", "/usr/sbin/slurmd", "-D", "-N", name],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env={**os.environ, **self.env()})

    def _said(self, name: str) -> str:
        logs = {"munged": "munge/munged.log", "slurmctld": "ctld/slurmctld.log"}
        path = self._path(logs.get(name, f"nodes/{name}/slurmd.log"))
        try:
            with open(path, errors="replace") as f:
                return f.read().strip()[-800:]
        except OSError:
            return "(no log)"


def _job_places() -> list[str]:
    """This Python, distgraph and the working directory: a job needs them at the same
    paths on every host."""
    import distgraph

    return [sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
            os.path.dirname(os.path.dirname(os.path.abspath(distgraph.__file__))),
            os.getcwd()]


def _tops_in_tmp(places) -> list[str]:
    """The folders below ``/tmp`` (which a node's own folder replaces) that hold
    ``places``, as paths relative to /tmp, none inside another: each is bound at its own
    path on a node, so that the rest of the node's /tmp (and of TMPDIR below it, as in a
    test run) stays the node's own."""
    tmp = os.path.realpath("/tmp")
    found = set()
    for place in places:
        rel = os.path.relpath(os.path.realpath(place), tmp)
        if rel != "." and not rel.startswith(".."):
            found.add(rel)
    return sorted(r for r in found
                  if not any(r != o and r.startswith(o + os.sep) for o in found))


def _write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
