"""Real hosts on one box, reached over OpenSSH: a resource file's machines as network
namespaces (the emulated cluster's, links shaped as the file says), each running the
real ``sshd`` under the machine's hostname, for tests and benchmarks of the ordinary
multi-host path (``distgraph run --hostfile``), not an emulation path.

Per machine: the network namespace and shaped link of :class:`Emulation`; a UTS
namespace with the machine's hostname; a mount namespace in which ``/etc/hosts`` names
every host, ``/tmp`` is the host's own (a folder of this run) and ``/dev/shm`` too (a
memory file system of its own), as on separate machines; an empty ``~/.bashrc`` (bash
runs it for every ssh command, and what it does lands in the one home all hosts share:
pyenv's rehash takes a lock there, which a host stopped mid-rehash would leave to hang
every other host's shell); and ``sshd -D`` on port 22. The launching host ("login") is
the emulation's hub namespace, under a hostname of its own with the same ``/etc/hosts``:
commands run there through :meth:`SshHosts.login_argv`. Everything else shares this box's files
(the Python, distgraph, the scripts: the same paths on every host, as with a shared
file system); where the job's own folders lie in ``/tmp`` (a checkout or a venv there),
each host's ``/tmp`` shows them at the same paths.

Keys, host keys, ``known_hosts`` and the client's ``ssh_config`` are generated per run in
a temporary folder; :attr:`SshHosts.launcher_exec` is a wrapper around ``ssh -F config``
that jobs get as ``HYDRA_LAUNCHER_EXEC``, as a site would set it. Leaving the context
kills every process in the namespaces (the servers included), deletes the namespaces
and the folder, also after an error or a signal.

Example (as root, with Debian's openssh-server installed)::

    with SshHosts(Cluster.from_file("resources/clusters/emulated_2x2.yaml")) as hosts:
        subprocess.run(hosts.login_argv(["distgraph", "run", "-n", "4", "--hostfile",
                                         hosts.hostfile(), "train.py"]),
                       env={**os.environ, **hosts.env()})
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import distgraph.errors
from distgraph.errors import PlanError, RuntimeFault
from distgraph.runtime.emulate.launch import TRANSPORT_ENV
from distgraph.runtime.emulate.layout import choose_subnet, emulated_job, this_job
from distgraph.runtime.emulate.namespaces import (
    Emulation,
    run_tool,
    check_prerequisites,
    taken_subnets,
)

SSHD = "/usr/sbin/sshd"
TOOLS = {"ssh": "openssh-client", "ssh-keygen": "openssh-client"}
LOGIN = "login"                 # the launching host's name
READY_SECONDS = 30
# Run inside a host's fresh UTS and mount namespaces: its name, its /etc/hosts, the
# mounts ("$4"... as source/target pairs; a target of /tmp already inside the host's own
# /tmp folder), a /dev/shm of its own (MPI's shared memory: what a host stopped with its
# ranks leaves there goes with it, not onto this box), an empty ~/.bashrc (module
# docstring), then that folder as /tmp with those mounts (it hides this box's).
HOST_SETUP = ('hostname "$1" && mount --bind "$2" /etc/hosts && tmp="$3" && shift 3 && '
              'while [ $# -gt 0 ]; do mount --bind "$1" "$2" && shift 2 || exit 1; done && '
              'mount -t tmpfs -o mode=1777 shm /dev/shm && '
              '{ [ ! -f "$HOME/.bashrc" ] || mount --bind /dev/null "$HOME/.bashrc"; } && '
              f'mount --rbind "$tmp" /tmp && exec {SSHD} -D -e -f /tmp/.sshd/sshd_config')
LOGIN_SETUP = 'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"'
SSHD_CONFIG = """\
ListenAddress {address}
HostKey /tmp/.sshd/host_key
AuthorizedKeysFile /tmp/.sshd/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PidFile none
PrintMotd no
MaxStartups 200
MaxSessions 200
LogLevel ERROR
"""
SSH_CONFIG = """\
Host *
    User {user}
    IdentityFile {folder}/client_key
    IdentitiesOnly yes
    UserKnownHostsFile {folder}/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    LogLevel ERROR
"""


def check_openssh() -> None:
    """Raise PlanError when the OpenSSH server or client is missing here."""
    missing = [f"{tool} ({pkg})" for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if not os.path.exists(SSHD):
        missing.append(f"{SSHD} (openssh-server)")
    if missing:
        raise PlanError(f"hosts with sshd need {', '.join(missing)}; install them "
                        "(apt-get install openssh-server openssh-client)")


class SshHosts:
    """``cluster``'s machines that host one of ``nprocs`` ranks (default: every device)
    as hosts running sshd (see the module docstring). ``absent`` names resolve to
    addresses of the hosts' network where nothing answers; ``mounts`` maps a hostname to
    (source, target) files bound on that host only (another distgraph version, say)."""

    def __init__(self, cluster, nprocs: int | None = None, absent=(), mounts=None, log=None):
        self.cluster = cluster
        self.nprocs = nprocs or len(cluster.devices)
        self.absent = tuple(absent)
        self.mounts = dict(mounts or {})
        self.log = sys.stderr if log is None else log
        self.layout = None
        self.folder = None
        self._emulation = None
        self._servers: dict[str, subprocess.Popen] = {}

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "SshHosts":
        check_prerequisites()
        check_openssh()
        job = this_job()
        self.layout = emulated_job(self.cluster, self.nprocs, job,
                                  choose_subnet(job, taken_subnets()))
        self._emulation = Emulation(self.layout, self.log)
        self._emulation.__enter__()
        try:
            self.folder = tempfile.mkdtemp(prefix="distgraph-sshd-")
            self._write_files()
            for m in self.layout.machines:
                self._start_server(m)
            self._wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._emulation.__exit__()        # kills every process in the namespaces
        finally:
            for server in self._servers.values():
                try:
                    server.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            self._servers = {}
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)

    # ---- what jobs use ---------------------------------------------------------------
    @property
    def hostnames(self) -> list[str]:
        return [m.hostname for m in self.layout.machines]

    @property
    def launcher_exec(self) -> str:
        return os.path.join(self.folder, "launcher-exec")

    def env(self) -> dict:
        """What a site sets for jobs here: hydra's ssh wrapper, and MPI over TCP on the
        hosts' interface (see :mod:`distgraph.runtime.emulate.launch`)."""
        return {"HYDRA_LAUNCHER_EXEC": self.launcher_exec, **TRANSPORT_ENV}

    def login_argv(self, argv: list[str]) -> list[str]:
        """``argv`` run on the launching host."""
        return ["ip", "netns", "exec", self.layout.hub_namespace, "unshare", "--uts",
                "--mount", "sh", "-c", LOGIN_SETUP, "login-setup", LOGIN,
                self._path("etc_hosts"), *argv]

    def hostfile(self, name: str = "hostfile", hosts=None) -> str:
        """An MPICH host file of ``hosts`` (default: every machine with its ranks' count
        as slots); its path."""
        lines = hosts or [f"{m.hostname}:{len(m.ranks)}" for m in self.layout.machines]
        path = self._path(name)
        with open(path, "w") as f:
            f.write("\n".join(lines) + "\n")
        return path

    @property
    def server_pids(self) -> list[int]:
        """The process ids of the hosts' sshd listeners."""
        return [self._servers[h].pid for h in self.hostnames]

    def tmp_of(self, hostname: str) -> str:
        """The folder that is ``/tmp`` on host ``hostname``."""
        return self._path("hosts", hostname, "tmp")

    def processes(self, hostname: str) -> list[int]:
        """Processes on host ``hostname`` other than its sshd listener."""
        namespace = self.layout.machine(hostname).namespace
        out = run_tool(["ip", "netns", "pids", namespace], f"list the processes of {hostname}")
        return sorted(int(p) for p in out.stdout.split()
                      if p.isdigit() and int(p) != self._servers[hostname].pid)

    def stop(self, hostname: str) -> None:
        """Host ``hostname`` goes away: every process on it (its sshd, a job's ranks and
        hydra's proxy) is killed, so that it neither answers over ssh nor runs anything."""
        namespace = self.layout.machine(hostname).namespace
        for _ in range(20):         # a process forked while the first were killed
            out = run_tool(["ip", "netns", "pids", namespace], f"list the processes of "
                           f"{hostname}")
            pids = [int(p) for p in out.stdout.split() if p.isdigit()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        self._servers[hostname].wait(timeout=10)

    def start(self, hostname: str) -> None:
        """Host ``hostname`` (stopped) comes back: its sshd again, answering."""
        self._start_server(self.layout.machine(hostname))
        self._wait_ready([hostname])

    # ---- making them -----------------------------------------------------------------
    def _path(self, *parts) -> str:
        return os.path.join(self.folder, *parts)

    def _write_files(self) -> None:
        keygen = ["ssh-keygen", "-q", "-t", "ed25519", "-N", ""]
        run_tool([*keygen, "-C", "distgraph-test-client", "-f", self._path("client_key")],
             "make the client's key")
        with open(self._path("client_key.pub")) as f:
            client_key = f.read()
        names = {LOGIN: self.layout.hub_address}
        names.update({m.hostname: m.address for m in self.layout.machines})
        names.update({name: f"{self.layout.subnet}.{250 - i}"
                      for i, name in enumerate(self.absent)})
        _write(self._path("etc_hosts"), "127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for name, address in names.items()))
        known = []
        for m in self.layout.machines:
            sshd = self._path("hosts", m.hostname, "tmp", ".sshd")
            os.makedirs(sshd)
            os.chmod(self.tmp_of(m.hostname), 0o1777)
            run_tool([*keygen, "-C", m.hostname, "-f", os.path.join(sshd, "host_key")],
                 f"make {m.hostname}'s host key")
            _write(os.path.join(sshd, "authorized_keys"), client_key)
            _write(os.path.join(sshd, "sshd_config"), SSHD_CONFIG.format(address=m.address))
            with open(os.path.join(sshd, "host_key.pub")) as f:
                kind, key = f.read().split()[:2]
            known.append(f"{m.hostname},{m.address} {kind} {key}\n")
        _write(self._path("known_hosts"), "".join(known))
        user = os.environ.get("USER") or "root"
        _write(self._path("ssh_config"), SSH_CONFIG.format(user=user, folder=self.folder))
        _write(self.launcher_exec, f"#!/bin/sh\nexec ssh -F {self._path('ssh_config')} "
                                   '"$@"\n', mode=0o755)

    def _start_server(self, m) -> None:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)   # sshd's privilege separation
        tmp = self.tmp_of(m.hostname)
        pairs = []
        for top in _job_folders_in_tmp():
            os.makedirs(os.path.join(tmp, top), exist_ok=True)
            pairs.append((os.path.join("/tmp", top), os.path.join(tmp, top)))
        for source, target in self.mounts.get(m.hostname, ()):
            inside = _below_tmp(target)
            pairs.append((source, target if inside is None else os.path.join(tmp, inside)))
        mounts = [p for pair in pairs for p in pair]
        with open(self._path("hosts", m.hostname, "sshd.log"), "w") as log:
            self._servers[m.hostname] = subprocess.Popen(
                ["ip", "netns", "exec", m.namespace, "unshare", "--uts", "--mount", "sh", "-c",
                 HOST_SETUP, "host-setup", m.hostname, self._path("etc_hosts"), tmp,
                 *mounts],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def _wait_ready(self, hosts=None) -> None:
        """Until every host (of ``hosts``) answers ``ssh HOST true`` from the launching
        host."""
        deadline = time.monotonic() + READY_SECONDS
        waiting = list(self.hostnames if hosts is None else hosts)
        while waiting:
            host = waiting[0]
            if self._servers[host].poll() is not None:
                raise RuntimeFault(f"sshd on {host} ended at start: {self._said(host)}")
            proc = subprocess.run(self.login_argv([self.launcher_exec, "-o", "BatchMode=yes",
                                                   host, "true"]),
                                  capture_output=True, text=True, timeout=READY_SECONDS)
            if proc.returncode == 0:
                waiting.pop(0)
            elif time.monotonic() > deadline:
                raise RuntimeFault(f"{host} did not answer over ssh within {READY_SECONDS} s: "
                                   f"{proc.stderr.strip()}; sshd said: {self._said(host)}")
            else:
                time.sleep(0.1)

    def _said(self, host: str) -> str:
        with open(self._path("hosts", host, "sshd.log"), errors="replace") as f:
            return f.read().strip()[-500:]


def _below_tmp(path: str) -> str | None:
    """``path`` relative to ``/tmp`` where it lies below it, else None."""
    rel = os.path.relpath(os.path.realpath(path), "/tmp")
    return None if rel == "." or rel.startswith("..") else rel


def _job_folders_in_tmp() -> list[str]:
    """The folders right below ``/tmp`` that hold this Python, distgraph or the working
    directory (a job started here needs them at the same paths on every host)."""
    places = (sys.prefix, sys.base_prefix, os.path.dirname(os.path.realpath(sys.executable)),
              os.path.dirname(os.path.dirname(os.path.abspath(distgraph.errors.__file__))),
              os.getcwd())
    tops = {rel.split(os.sep)[0] for rel in map(_below_tmp, places) if rel is not None}
    return sorted(tops)


def _write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)
