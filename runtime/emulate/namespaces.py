"""Emulated clusters: a resource file's machines as Linux network namespaces, linked by
veth pairs through a bridge and shaped per pair of machines with ``tc``.

What one job creates (all named ``distgraph-<pid>.<start>-<role>``, see
:mod:`distgraph.runtime.emulate.layout`), and nothing outside it:

- a *hub* namespace holding a bridge (``br0``, the job's ``.1`` address) where
  ``mpiexec`` runs: the launcher's control traffic goes to the hub and is never shaped or
  faulted, so a broken machine link still lets the job be stopped;
- per machine, a namespace whose interface ``dg0`` (one end of a veth; the other is
  on the bridge) holds the machine's address;
- where the machines differ in speed, a CPU-quota cgroup per machine
  (:mod:`distgraph.runtime.emulate.cgroups`), which the machine's ranks run in;
- on each machine's ``dg0``, an HTB root that classifies by destination address (u32)
  into one class per other machine, whose leaf is a token bucket (``tbf``) at the pair's
  bandwidth, with a ``netem`` delay of the pair's latency under it when the kernel has
  netem. Shaping on the sender's side, per destination, gives each ordered pair exactly
  its own figure; traffic to the hub is not classified and leaves unshaped. Pairs do not
  share a bottleneck: contention on links the file shares between pairs is not modelled.

:class:`Emulation` is a context manager: entering creates everything (after removing what
killed earlier jobs left, see :func:`remove_leftovers`), leaving removes it, also after an
error, Ctrl-C, SIGTERM or SIGHUP (which it turns into :class:`Terminated`, a
KeyboardInterrupt, so ``finally`` blocks run). Removal kills every process still inside the
job's namespaces, then deletes them (a veth or qdisc dies with its namespace), then
kills what is left in the job's cgroups and removes them.

Example (as root)::

    layout = emulated_job(cluster, 4, this_job(), choose_subnet(this_job(), taken_subnets()))
    with Emulation(layout) as emu:
        subprocess.run(["ip", "netns", "exec", layout.hub_namespace, ...])
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

from distgraph.errors import PlanError, RuntimeFault
from distgraph.runtime.emulate.cgroups import CpuGroups, our_groups, remove_groups
from distgraph.runtime.emulate.layout import (PREFIX, EmulatedJob, parse_namespace, process_start,
                                              subnets_of)

IFACE = "dg0"                  # every machine's interface, inside its namespace
TOOLS = {"ip": "iproute2", "tc": "iproute2", "unshare": "util-linux"}
BURST_BYTES = 96 * 1024        # above a 64 KiB GSO packet, so tbf never splits one
BURST_SECONDS = 200e-6         # at high rates the bucket holds 200 µs of traffic
QUEUE_BYTES = 8 * 2**20        # tbf queue: several sockets' worth of TCP small queues
STALL_RATE_BITS = 8000         # a stalled link trickles 1 kB/s
STALL_BURST_BYTES = 2000
KILL_GRACE_SECONDS = 1.0
LINK_STATES = ("down", "stall", "up")
FOLDER_KINDS = ("emulate", "elastic")     # a job's temporary folders: distgraph-<kind>-<job>-*
TERMINATING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while an emulated cluster was up; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


def check_prerequisites() -> None:
    """Raise PlanError, before anything is created, when this process cannot emulate."""
    if not sys.platform.startswith("linux"):
        raise PlanError(f"emulated clusters need Linux network namespaces; this is "
                        f"{sys.platform}. Run without --emulate")
    if os.geteuid() != 0:
        raise PlanError("emulated clusters need root (they create network namespaces and "
                        "shape links with tc): run as root, or without --emulate")
    missing = [f"{tool} ({pkg})" for tool, pkg in TOOLS.items() if shutil.which(tool) is None]
    if missing:
        raise PlanError(f"emulated clusters need {', '.join(missing)} on PATH; install them "
                        "or run without --emulate")


def run_tool(argv: list[str], what: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise RuntimeFault(f"emulated cluster: could not {what}: `{' '.join(argv)}` said: "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def our_namespaces() -> list[str]:
    """Names of the network namespaces that distgraph jobs made (any job)."""
    out = run_tool(["ip", "netns", "list"], "list network namespaces").stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return sorted(n for n in names if parse_namespace(n) is not None)


def job_alive(pid: int, start: int) -> bool:
    return process_start(pid) == start


def remove_job(job: str, log=None) -> list[str]:
    """Kill every process inside job ``job``'s namespaces, then delete them, then its
    cgroups; the namespace names removed. Goes on past errors and raises RuntimeFault
    naming them at the end."""
    names = [n for n in our_namespaces() if n.startswith(f"{PREFIX}{job}-")]
    pids = set()
    for ns in names:
        pids |= namespace_pids(ns)
    _kill(pids)
    errors = []
    for ns in names:
        proc = run_tool(["ip", "netns", "del", ns], f"delete {ns}", check=False)
        if proc.returncode != 0:
            errors.append(f"{ns}: {proc.stderr.strip()}")
    problems = []
    if errors:
        problems.append("emulated cluster: could not delete " + "; ".join(errors) +
                        "; delete them with `ip netns del NAME`")
    try:
        remove_groups(job)
    except RuntimeFault as err:
        problems.append(str(err))
    if problems:
        raise RuntimeFault("; ".join(problems))
    return names


def _kill(pids: set[int]) -> None:
    """SIGTERM, then SIGKILL after a grace period, for the processes still alive."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = set()
        for pid in pids:
            try:
                os.kill(pid, sig)
                alive.add(pid)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + KILL_GRACE_SECONDS
        while alive and time.monotonic() < deadline:
            alive = {p for p in alive if _exists(p)}
            time.sleep(0.02)
        pids = alive
        if not pids:
            return


def _exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def remove_leftovers(log=None) -> list[str]:
    """Remove the namespaces of distgraph jobs whose launcher is gone (killed with
    SIGKILL, or a crash); the names removed. Jobs still running are left alone."""
    jobs = {}
    for name in our_namespaces() + [os.path.basename(p) for p in our_groups()]:
        pid, start, _ = parse_namespace(name)
        jobs[f"{pid}.{start}"] = (pid, start)
    for folder in leftover_folders("*"):
        job = os.path.basename(folder).split("-")[2]
        pid, _, start = job.partition(".")
        if pid.isdigit() and start.isdigit():
            jobs.setdefault(job, (int(pid), int(start)))
    removed = []
    for job, (pid, start) in sorted(jobs.items()):
        if not job_alive(pid, start):
            gone = remove_job(job)
            removed += gone
            for folder in leftover_folders(job):
                shutil.rmtree(folder, ignore_errors=True)
            if log is not None and gone:
                log.write(f"distgraph: removed {len(gone)} namespaces left by emulated job "
                          f"{job}, whose launcher (pid {pid}) is gone\n")
    return removed


def other_jobs(job: str) -> list[str]:
    """One line per other distgraph job whose namespaces are here, and whose launcher
    runs: ``job 842.417664 (pid 842: distgraph run -n 4 --emulate ...)``."""
    lines = []
    for name in our_namespaces():
        pid, start, _ = parse_namespace(name)
        other = f"{pid}.{start}"
        if other == job or not job_alive(pid, start) or any(f"job {other} " in ln
                                                            for ln in lines):
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            command = "?"
        lines.append(f"job {other} (pid {pid}: {command[:120]})")
    return lines


def leftover_folders(job: str) -> list[str]:
    """The temporary folders of emulated job ``job`` (``distgraph-emulate-<job>-*``,
    ``distgraph-elastic-<job>-*``): what a killed launcher leaves beside its namespaces."""
    import glob
    import tempfile

    return sorted(p for kind in FOLDER_KINDS
                  for p in glob.glob(os.path.join(tempfile.gettempdir(),
                                                  folder_prefix(kind, job) + "*")))


def folder_prefix(kind: str, job: str) -> str:
    """The prefix of a temporary folder of ``job`` (``kind``: one of
    :data:`FOLDER_KINDS`), so that :func:`remove_leftovers` finds the folder once the
    job's launcher is gone (killed: its ``TemporaryDirectory`` was never removed)."""
    return f"{PREFIX}{kind}-{job}-"


def taken_subnets() -> set[str]:
    """/24 prefixes under 10/8 in use here: on this namespace's addresses and routes,
    and on the namespaces of other distgraph jobs."""
    cidrs = []
    for argv in (["ip", "-4", "-o", "addr", "show"], ["ip", "-4", "route", "show"]):
        for line in run_tool(argv, "list addresses").stdout.splitlines():
            for word in line.split():
                if word[:1].isdigit() and word.count(".") == 3:
                    cidrs.append(word if "/" in word else word + "/32")
    for ns in our_namespaces():
        out = run_tool(["ip", "-n", ns, "-4", "-o", "addr", "show"], f"list {ns}", check=False)
        cidrs += [w for w in out.stdout.split() if "/" in w and w[:1].isdigit()]
    return subnets_of(cidrs)


class Emulation:
    """Creates a :class:`EmulatedJob`'s namespaces, links and shaping on enter; removes them
    on exit (see the module docstring)."""

    def __init__(self, layout: EmulatedJob, log=None):
        self.layout = layout
        self.log = sys.stderr if log is None else log
        self.delay_supported: bool | None = None
        self._handlers: dict = {}
        self._states: dict = {}
        self.groups = CpuGroups(layout) if layout.throttled else None

    # ---- lifecycle -------------------------------------------------------------------
    def __enter__(self) -> "Emulation":
        self._catch_termination()
        try:
            remove_leftovers(self.log)
            others = other_jobs(self.layout.job)
            if others:
                # they cannot meet this one (own namespaces, addresses only inside them),
                # but they share this machine's cores
                self.log.write(f"distgraph: {len(others)} other emulated cluster"
                               f"{'s run' if len(others) > 1 else ' runs'} on this machine "
                               f"({'; '.join(others)}): its ranks share the cores, so "
                               "timings and shaped bandwidths may be off while "
                               f"{'they run' if len(others) > 1 else 'it runs'}\n")
                self.log.flush()
            self._setup()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()

    def _catch_termination(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def terminated(signum, frame):
            raise Terminated(signum)

        for sig in TERMINATING[1:]:
            self._handlers[sig] = signal.signal(sig, terminated)

    def _teardown(self) -> None:
        # A second Ctrl-C must not cut the removal short: hold signals until it is done.
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINATING)
        try:
            remove_job(self.layout.job, self.log)
        finally:
            try:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            finally:
                for sig, handler in self._handlers.items():
                    signal.signal(sig, handler)
                self._handlers = {}

    # ---- creating ------------------------------------------------------------------------
    def _setup(self) -> None:
        L = self.layout
        hub = L.hub_namespace
        for ns in L.namespaces:
            run_tool(["ip", "netns", "add", ns], f"create namespace {ns}")
            run_tool(["ip", "-n", ns, "link", "set", "lo", "up"], f"bring up lo in {ns}")
        run_tool(["ip", "-n", hub, "link", "add", "br0", "type", "bridge"], "create the bridge")
        run_tool(["ip", "-n", hub, "addr", "add", f"{L.hub_address}/24", "dev", "br0"],
             "address the bridge")
        run_tool(["ip", "-n", hub, "link", "set", "br0", "up"], "bring up the bridge")
        for m in L.machines:
            port = f"m{m.index}"
            run_tool(["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", IFACE,
                  "netns", m.namespace], f"link {m.hostname} to the bridge")
            run_tool(["ip", "-n", hub, "link", "set", port, "master", "br0", "up"],
                 f"attach {m.hostname}'s link to the bridge")
            run_tool(["ip", "-n", m.namespace, "addr", "add", f"{m.address}/24", "dev", IFACE],
                 f"address {m.hostname}")
            run_tool(["ip", "-n", m.namespace, "link", "set", IFACE, "up"], f"bring up {m.hostname}")
        self.delay_supported = self._probe_netem()
        if not self.delay_supported and any(s.latency_us > 0 for s in L.shapes):
            worst = max(s.latency_us for s in L.shapes)
            self.log.write(
                "distgraph: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM), so the "
                f"emulated links add no delay: inter-machine latency is the veth's own (tens "
                f"of us) instead of the file's (up to {worst:g} us); bandwidth is shaped\n")
        for m in L.machines:
            self._shape(m)
        if self.groups is not None:
            self.groups.create()

    def procs_files(self) -> dict[str, str]:
        """{machine address: its cgroup's procs file}; empty when no machine is slowed."""
        return {} if self.groups is None else self.groups.procs_files()

    def _probe_netem(self) -> bool:
        ns = self.layout.hub_namespace
        proc = run_tool(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                     "1us"], "probe netem", check=False)
        if proc.returncode == 0:
            run_tool(["tc", "-n", ns, "qdisc", "del", "dev", "lo", "root"], "remove the netem probe")
        return proc.returncode == 0

    def _tc(self, machine, *args, what="shape a link"):
        return run_tool(["tc", "-n", machine.namespace, *args], f"{what} of {machine.hostname}")

    def _shape(self, m) -> None:
        self._tc(m, "qdisc", "add", "dev", IFACE, "root", "handle", "1:", "htb")
        for s in self.layout.shapes:
            if s.src != m.index:
                continue
            dst = self.layout.machines[s.dst]
            minor = _minor(s.dst)
            # The class only sorts traffic by destination; its leaf tbf does the shaping.
            rate = f"{2 * s.rate_bits}bit"
            self._tc(m, "class", "add", "dev", IFACE, "parent", "1:", "classid", f"1:{minor:x}",
                     "htb", "rate", rate, "ceil", rate, "quantum", "60000")
            self._leaf(m, s, "add", stalled=False)
            self._tc(m, "filter", "add", "dev", IFACE, "parent", "1:", "protocol", "ip",
                     "prio", "1", "u32", "match", "ip", "dst", f"{dst.address}/32",
                     "flowid", f"1:{minor:x}")

    def _leaf(self, m, s, verb: str, stalled: bool) -> None:
        """The class's leaf: tbf at the pair's rate (or the stall rate), netem under it."""
        minor = _minor(s.dst)
        if stalled:
            rate, burst = STALL_RATE_BITS, STALL_BURST_BYTES
        else:
            rate, burst = s.rate_bits, max(BURST_BYTES, int(s.rate_bits / 8 * BURST_SECONDS))
        self._tc(m, "qdisc", verb, "dev", IFACE, "parent", f"1:{minor:x}", "handle",
                 f"{minor:x}:", "tbf", "rate", f"{rate}bit", "burst", str(burst),
                 "limit", str(QUEUE_BYTES))
        if verb != "change" and self.delay_supported and s.latency_us > 0:
            self._tc(m, "qdisc", "add", "dev", IFACE, "parent", f"{minor:x}:1",
                     "handle", f"{minor + 0x1000:x}:", "netem", "delay",
                     f"{s.latency_us:g}us", "limit", "100000")

    # ---- faults ----------------------------------------------------------------------
    def set_link(self, a: str, b: str, state: str) -> None:
        """Set both directions between machines ``a`` and ``b`` (hostnames) to ``state``:
        "down" (every packet dropped), "stall" (held back: the link trickles 1 kB/s) or
        "up" (shaped as the file says; what a stall held back leaves at once)."""
        if state not in LINK_STATES:
            raise PlanError(f"link state {state!r}; use one of {', '.join(LINK_STATES)}")
        ma, mb = self.layout.machine(a), self.layout.machine(b)
        for src, dst in ((ma, mb), (mb, ma)):
            s = self.layout.shape(src.index, dst.index)
            old = self._states.get((src.index, dst.index), "up")
            if state == "down":
                # A fifo of length 0 drops every packet; replacing the leaf drops its queue.
                minor = _minor(dst.index)
                self._tc(src, "qdisc", "replace", "dev", IFACE, "parent", f"1:{minor:x}",
                         "handle", f"{minor + 0x2000:x}:", "pfifo", "limit", "0",
                         what="cut a link")
            elif old == "down":
                self._leaf(src, s, "replace", stalled=state == "stall")
            elif old != state:
                # Changing a tbf keeps its queue and refills its bucket.
                self._leaf(src, s, "change", stalled=state == "stall")
                if state == "up":
                    self._kick(src)
            self._states[src.index, dst.index] = state

    def _kick(self, m) -> None:
        """Send one datagram to the hub from machine ``m``: the qdisc then dequeues, and a
        restored link releases what it held without waiting for TCP's next timer."""
        send = ("import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto("
                f"b'', ('{self.layout.hub_address}', 9))")
        run_tool(["ip", "netns", "exec", m.namespace, sys.executable, "-c", send],
             "wake a restored link")


    def set_machine(self, hostname: str, state: str) -> None:
        """"down": machine ``hostname`` is lost: every process inside it is killed with
        SIGKILL, then its interface goes down, so nothing reaches it (nor the launcher);
        "up": its interface comes back, with nothing running on it."""
        if state not in ("down", "up"):
            raise PlanError(f"machine state {state!r}; use 'down' or 'up'")
        m = self.layout.machine(hostname)
        if state == "down":
            _signal_all(namespace_pids(m.namespace), signal.SIGKILL)
        run_tool(["ip", "-n", m.namespace, "link", "set", IFACE, state],
                 f"set {hostname}'s network {state}")

    def clear(self) -> list[int]:
        """Kill every process in the machines' namespaces (a job's leftovers: ranks,
        proxies); the namespaces stay. The pids that were found."""
        pids = set()
        for m in self.layout.machines:
            pids |= namespace_pids(m.namespace)
        _kill(pids)
        return sorted(pids)


def namespace_pids(namespace: str) -> set[int]:
    """The processes inside network namespace ``namespace``."""
    out = run_tool(["ip", "netns", "pids", namespace], f"list the processes in {namespace}",
                   check=False)
    return {int(p) for p in out.stdout.split() if p.isdigit()}


def _signal_all(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _minor(machine_index: int) -> int:
    """The HTB class (and tbf handle) of traffic towards machine ``machine_index``."""
    return 0x10 + machine_index
