"""CPU quotas for emulated machines: each slower machine's ranks in a cgroup.

Where the file's machines differ in speed (:attr:`EmulatedJob.throttled
<distgraph.runtime.emulate.layout.EmulatedJob.throttled>`), every machine of the job gets a
control group ``distgraph-<pid>.<start>-m<i>`` (named like the job's namespaces, so a
later run can tell whether its job is alive) at the root of the cpu controller's
hierarchy, holding:

- a bandwidth limit of ``EmulatedMachine.cpu_cores`` cores (v1: ``cpu.cfs_quota_us`` over
  ``cpu.cfs_period_us``; v2: ``cpu.max``) over a short period (:data:`PERIOD_US`), so a
  step of a few milliseconds already sees its machine's speed;
- a weight in proportion to those cores (v1 ``cpu.shares``, v2 ``cpu.weight``), so that
  when the ranks want more CPU than the box has, the machines still get CPU in the
  ratio of their speeds (with equal weights, two groups would split the box evenly
  however their quotas differ).

The launcher's helper (:mod:`distgraph.runtime.emulate.exec`) moves each machine's proxy
into its group before it starts the machine's ranks, which inherit it. Removal kills
whatever is still inside a group, then removes the group; :func:`remove_groups` goes on
past errors and names what it could not remove.

Example (as root)::

    groups = CpuGroups(layout)            # PlanError where no cpu controller is mounted
    groups.create()
    groups.procs_files()                  # {machine address: its cgroup.procs}
    remove_groups(layout.job)
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from distgraph.errors import PlanError, RuntimeFault
from distgraph.runtime.emulate.layout import PREFIX, EmulatedJob, parse_namespace

MOUNTINFO = "/proc/self/mountinfo"
PERIOD_US = 10_000           # 10 ms: fine enough for steps of milliseconds
LONG_PERIOD_US = 100_000     # for machines so slow that 10 ms would give under 1 ms
MIN_QUOTA_US = 1_000         # the kernel's smallest quota
REMOVE_SECONDS = 5.0


@dataclass(frozen=True)
class CpuController:
    """Where the cpu controller is mounted: ``version`` 1 (its own hierarchy) or 2 (the
    unified hierarchy, with ``cpu`` among its controllers)."""

    version: int
    root: str

    def group(self, name: str) -> str:
        return os.path.join(self.root, name)


def find_controller(mountinfo: str, controllers=None) -> CpuController | None:
    """The cpu controller in ``mountinfo`` (the text of /proc/self/mountinfo), v1 first;
    None where neither is there. ``controllers(path)`` reads a v2 mount's
    ``cgroup.controllers`` (default: the file)."""
    controllers = controllers or _read
    v2 = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        fstype, _source, options = (line.split(" - ", 1)[1].split() + ["", ""])[:3]
        point = _unescape(fields[4])
        if fstype == "cgroup" and "cpu" in options.split(","):
            return CpuController(1, point)
        if fstype == "cgroup2":
            v2.append(point)
    for point in v2:
        if "cpu" in controllers(os.path.join(point, "cgroup.controllers")).split():
            return CpuController(2, point)
    return None


def cpu_controller() -> CpuController | None:
    """This machine's cpu controller, None where it has none."""
    return find_controller(_read(MOUNTINFO))


def require_controller(mountinfo: str | None = None) -> CpuController:
    """The cpu controller (in ``mountinfo``, default this process's), or a one-line
    PlanError saying that speeds cannot be emulated here."""
    found = cpu_controller() if mountinfo is None else find_controller(mountinfo)
    if found is None:
        raise PlanError("the file's machines differ in speed, but this machine has no cgroup "
                        "cpu controller (v1 cpu.cfs_quota_us or v2 cpu.max) to slow their "
                        "ranks down: mount one, or give every device the same gflops")
    return found


def quota(cores: float) -> tuple[int, int, int]:
    """(period µs, quota µs, weight per 1024) of a group that may use ``cores`` cores."""
    period = PERIOD_US if cores * PERIOD_US >= MIN_QUOTA_US else LONG_PERIOD_US
    limit = round(cores * period)
    if limit < MIN_QUOTA_US:
        raise PlanError(f"an emulated machine that computes at {cores:.2g} cores needs a "
                        f"quota below the kernel's {MIN_QUOTA_US} us per {period} us; give "
                        "the slowest device at least 1% of the fastest's gflops")
    return period, limit, max(2, round(1024 * cores))


class CpuGroups:
    """The cgroups of ``layout``'s machines (see the module docstring)."""

    def __init__(self, layout: EmulatedJob, controller: CpuController | None = None):
        self.layout = layout
        self.controller = controller or require_controller()
        self.paths = {m.index: self.controller.group(f"{PREFIX}{layout.job}-m{m.index}")
                      for m in layout.machines}

    def create(self) -> None:
        c = self.controller
        if c.version == 2:
            self._enable_cpu_below_root()
        for m in self.layout.machines:
            path = self.paths[m.index]
            period, limit, weight = quota(m.cpu_cores)
            _mkdir(path)
            if c.version == 1:
                _write(path, "cpu.cfs_period_us", period)
                _write(path, "cpu.cfs_quota_us", limit)
                _write(path, "cpu.shares", weight)
            else:
                _write(path, "cpu.max", f"{limit} {period}")
                # v2 weights run 1..10000 around 100 where v1 shares run around 1024
                _write(path, "cpu.weight", min(10000, max(1, round(weight * 100 / 1024))))

    def procs_files(self) -> dict[str, str]:
        """{machine address: the cgroup.procs file its proxy writes its pid to}, reached
        through the launcher's root (``/proc/<pid>/root/...``): the proxies start under
        ``ip netns exec``, which mounts a fresh /sys that hides the cgroup hierarchies."""
        launcher = self.layout.job.split(".")[0]
        return {m.address: f"/proc/{launcher}/root" +
                os.path.join(self.paths[m.index], "cgroup.procs")
                for m in self.layout.machines}

    def _enable_cpu_below_root(self) -> None:
        control = os.path.join(self.controller.root, "cgroup.subtree_control")
        if "cpu" not in _read(control).split():
            _write(self.controller.root, "cgroup.subtree_control", "+cpu")


def our_groups(controller: CpuController | None = None) -> list[str]:
    """Paths of the cgroups distgraph jobs made (any job), none without a controller."""
    controller = controller or cpu_controller()
    if controller is None:
        return []
    try:
        names = os.listdir(controller.root)
    except OSError:
        return []
    return sorted(controller.group(n) for n in names
                  if parse_namespace(n) is not None and os.path.isdir(controller.group(n)))


def remove_groups(job: str, controller: CpuController | None = None) -> list[str]:
    """Kill what is still in job ``job``'s cgroups and remove them; the paths removed.
    Goes on past errors and raises RuntimeFault naming them at the end."""
    paths = [p for p in our_groups(controller)
             if os.path.basename(p).startswith(f"{PREFIX}{job}-")]
    errors = []
    for path in paths:
        error = _remove(path)
        if error:
            errors.append(error)
    if errors:
        raise RuntimeFault("emulated cluster: could not remove cgroups: " + "; ".join(errors) +
                           "; kill the processes listed in their cgroup.procs and rmdir them")
    return paths


def _remove(path: str) -> str | None:
    deadline = time.monotonic() + REMOVE_SECONDS
    while True:
        for pid in _members(path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.rmdir(path)
            return None
        except FileNotFoundError:
            return None
        except OSError as err:
            if time.monotonic() > deadline:
                return f"{path}: {err.strerror}"
        time.sleep(0.02)


def _members(path: str) -> list[int]:
    return [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]


def _mkdir(path: str) -> None:
    try:
        os.mkdir(path)
    except OSError as err:
        raise RuntimeFault(f"emulated cluster: could not create cgroup {path}: "
                           f"{err.strerror}") from None


def _write(folder: str, name: str, value) -> None:
    path = os.path.join(folder, name)
    try:
        with open(path, "w") as f:
            f.write(f"{value}\n")
    except OSError as err:
        raise RuntimeFault(f"emulated cluster: could not write {value!r} to {path}: "
                           f"{err.strerror}") from None


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _unescape(field: str) -> str:
    """mountinfo writes a space in a path as \\040 (and tab, newline, backslash alike)."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field
