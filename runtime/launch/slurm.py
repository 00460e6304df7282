"""Slurm allocations: where ``distgraph run`` puts its ranks inside ``salloc``, ``sbatch``
or a one-task ``srun``, without a host file.

Inside an allocation (``SLURM_JOB_ID`` and ``SLURM_JOB_NODELIST`` set) the ranks go on
the allocation's nodes, expanded from ``SLURM_JOB_NODELIST`` (``node[0-3,7]``), each with
as many slots as the allocation gave it tasks: ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) in
a batch script or an ``salloc`` shell. Inside a job step (``srun``, or the interactive
step of ``salloc`` where a site sets ``LaunchParameters=use_interactive_step``), whose
``SLURM_TASKS_PER_NODE`` describe the step, the job's CPUs per node
(``SLURM_JOB_CPUS_PER_NODE``) divided by ``SLURM_CPUS_PER_TASK`` (default 1) are the slots.
``-n`` defaults to the allocation's tasks (``SLURM_NTASKS`` where the job asked for a
number, else the slots' sum) and may not exceed the slots: hydra would start the excess
on the nodes' CPUs of other jobs.

hydra then starts the ranks through its Slurm launcher (``srun``, one step of the job
with a ``hydra_pmi_proxy`` per node), as the checks before and the clean-up after do
(:mod:`distgraph.runtime.launch.remote`): every process of the job is then one of the
job's steps, which ``scancel`` ends and Slurm accounts for, and no node needs ssh. The
nodes are still named to hydra as hosts (``-hosts node0:2,node1:2``), not left to its
own reading of the allocation, so that the placement is the one ``--dry-run`` prints and
that an elastic restart (:mod:`distgraph.runtime.launch.elastic_hosts`) can leave nodes
out.

``distgraph run`` starts the ranks itself and runs once per job: started as several
tasks of one ``srun`` step it refuses (every task would start a whole job).

A node that Slurm no longer runs work on (drained or draining, down, failing, not
responding: :func:`unavailable`) is lost to an elastic job, as a host that stopped
answering over ssh.

Example::

    >>> expand_nodelist("gpu[01-02],cpu7")
    ('gpu01', 'gpu02', 'cpu7')
    >>> expand_counts("2(x2),1")
    (2, 2, 1)
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from distgraph.errors import PlanError
from distgraph.runtime.launch.hosts import HostAssignment, HostSlots, place_on_slots

# sinfo's long node states (``%T``) in which a node takes no work: a drain is asked for
# (draining: jobs still run there; drained), the node is down, failing, being rebooted,
# in maintenance or powered down. A ``*`` suffix means it does not respond.
LOST_STATES = ("drain", "down", "fail", "reboot", "maint", "power", "future", "unknown")
SINFO_TIMEOUT = 10.0


@dataclass(frozen=True)
class Allocation:
    """A Slurm job's nodes and the ranks each may run (``slots``), as its environment
    says them (module docstring); ``tasks`` is the number of tasks the job asked for
    (None: it asked for nodes only)."""

    job: str
    nodelist: str
    nodes: tuple[str, ...]
    slots: tuple[int, ...]
    tasks: int | None = None

    @property
    def total(self) -> int:
        return sum(self.slots)

    @property
    def default_ranks(self) -> int:
        return self.tasks if self.tasks is not None else self.total

    def __str__(self):
        per = ",".join(f"{s}(x{n})" if n > 1 else str(s) for s, n in _runs(self.slots))
        return f"Slurm job {self.job} on {self.nodelist} with {per} tasks per node"

    def assignment(self, nprocs: int) -> HostAssignment:
        """Ranks 0..nprocs-1 on the nodes' slots in order; PlanError past the slots."""
        if nprocs > self.total:
            raise PlanError(
                f"-n {nprocs}: {self} has {self.total} task slots; use -n {self.total} or "
                "fewer, or ask salloc/sbatch for more (-N, --ntasks-per-node)")
        entries = [HostSlots(n, s) for n, s in zip(self.nodes, self.slots)]
        return place_on_slots(entries, nprocs, str(self))

    def check_hosts(self, assignment: HostAssignment, local) -> None:
        """PlanError when ``assignment`` (from --hostfile or --hosts) names a host outside
        the allocation that is not this one (``local(host)``): srun reaches only the
        job's nodes."""
        outside = [h for h in assignment.distinct_hosts if h not in self.nodes and not local(h)]
        if outside:
            raise PlanError(f"{assignment.source}: {', '.join(outside)} "
                            f"{'is' if len(outside) == 1 else 'are'} not among the nodes of "
                            f"{self}; hydra starts ranks through srun, which reaches only "
                            "those: name its nodes, or leave --hostfile/--hosts out")


def expand_nodelist(text: str) -> tuple[str, ...]:
    """Slurm's host list (``node[0-3,7],gpu[01-02]``, several bracket groups per name
    too: ``r[1-2]n[1-2]``) as names; zero padding is kept."""
    names = []
    for item in _split_top(text.strip(), text):
        parts = re.split(r"(\[[^\]]*\])", item)
        expanded = [""]
        for part in parts:
            if part.startswith("["):
                expanded = [e + n for e in expanded for n in _range(part[1:-1], text)]
            elif "[" in part or "]" in part:
                raise _bad_list(text)
            else:
                expanded = [e + part for e in expanded]
        names += expanded
    return tuple(names)


def expand_counts(text: str) -> tuple[int, ...]:
    """Slurm's per-node counts (``2(x3),1``) as one number per node."""
    counts = []
    for item in text.strip().split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise PlanError(f"{text!r} is not a Slurm count list such as '2(x3),1'")
        counts += [int(m[1])] * int(m[2] or 1)
    return tuple(counts)


def allocation_from_env(env) -> Allocation | None:
    """The allocation this process runs in (module docstring); None outside one. Raises
    PlanError when it does not add up, or when this process is one of several tasks of
    an srun step."""
    job, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
    if not job or not nodelist:
        return None
    in_step = bool(env.get("SLURM_STEP_ID"))
    step_tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 1)
    if in_step and step_tasks > 1:
        raise PlanError(
            f"started as {step_tasks} tasks of srun (job {job}, step "
            f"{env['SLURM_STEP_ID']}); it starts every rank itself: run it once, in the "
            "sbatch script or the salloc shell, or as one task (srun -N 1 -n 1 distgraph "
            "run ...)")
    nodes = expand_nodelist(nodelist)
    if in_step:
        var = "SLURM_JOB_CPUS_PER_NODE"
        per_task = int(env.get("SLURM_CPUS_PER_TASK") or 1)
        slots = tuple(c // per_task for c in expand_counts(env.get(var) or "1"))
        tasks = None
    else:
        var = "SLURM_TASKS_PER_NODE"
        slots = expand_counts(env.get(var) or "1")
        tasks = int(env["SLURM_NTASKS"]) if env.get("SLURM_NTASKS") else None
    if len(slots) != len(nodes):
        raise PlanError(f"Slurm job {job}: {var}={env.get(var)} gives {len(slots)} nodes, "
                        f"SLURM_JOB_NODELIST={nodelist} {len(nodes)}")
    return Allocation(job, nodelist, nodes, slots, tasks)


def ranks(nprocs: int | None, allocation: Allocation | None) -> int:
    """``-n``: as given, else the allocation's tasks; PlanError when neither is there."""
    if nprocs is not None:
        return nprocs
    if allocation is None:
        raise PlanError("the following arguments are required: -n/--nprocs (the number "
                        "of ranks; inside a Slurm allocation it defaults to its tasks)")
    return allocation.default_ranks


def placement(assignment: HostAssignment | None, allocation: Allocation | None,
              nprocs: int, env) -> HostAssignment | None:
    """Where the ranks go inside ``allocation``: ``assignment`` (of --hostfile, --hosts,
    --cluster) when there is one, checked against the allocation where hydra goes
    through srun; else the allocation's nodes. Outside an allocation, ``assignment``."""
    if allocation is None:
        return assignment
    if assignment is None:
        return allocation.assignment(nprocs)
    from distgraph.runtime.launch.remote import Launcher, is_local

    if not assignment.devices and Launcher.from_env(env).kind == "slurm":
        allocation.check_hosts(assignment, is_local)
    return assignment


def unavailable(names, env=None, timeout: float = SINFO_TIMEOUT) -> dict[str, str]:
    """Which of the nodes ``names`` Slurm runs no work on, with their state as sinfo
    says it (``draining``, ``down*``...); a node sinfo does not list is ``unknown``.
    Raises PlanError when sinfo cannot be asked."""
    names = list(dict.fromkeys(names))
    if not names:
        return {}
    argv = ["sinfo", "--noheader", "--Node", f"--nodes={','.join(names)}", "--format=%N %T"]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PlanError(f"cannot ask Slurm for the nodes' states (`{' '.join(argv)}`: "
                        f"{err})") from None
    if proc.returncode != 0:
        raise PlanError(f"cannot ask Slurm for the nodes' states (`{' '.join(argv)}` said: "
                        f"{proc.stderr.strip()})")
    states = {}
    for line in proc.stdout.splitlines():
        words = line.split()
        if len(words) == 2:
            # a node in several partitions is listed once per partition, alike
            states[words[0]] = words[1].lower()
    return {n: states.get(n, "unknown") for n in names if _lost(states.get(n, "unknown"))}


def _lost(state: str) -> bool:
    return state.endswith("*") or any(word in state for word in LOST_STATES)


def _split_top(text: str, whole: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += {"[": 1, "]": -1}.get(c, 0)
        if depth not in (0, 1):
            raise _bad_list(whole)
        if c == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth != 0 or any(not item for item in items):
        raise _bad_list(whole)
    return items


def _range(text: str, whole: str) -> list[str]:
    """``0-3,7`` / ``01-02`` as the numbers, zero-padded as written."""
    out = []
    for piece in text.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", piece.strip())
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise _bad_list(whole)
        width = len(m[1]) if m[1].startswith("0") else 0
        out += [str(i).zfill(width) for i in range(int(m[1]), int(m[2] or m[1]) + 1)]
    return out


def _bad_list(text: str) -> PlanError:
    return PlanError(f"SLURM_JOB_NODELIST={text!r} is not a Slurm host list such as "
                     "'node[0-3,7],gpu01'")


def _runs(values):
    runs: list[list] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs
