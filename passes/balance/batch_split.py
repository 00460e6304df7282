"""The balanced split of a batch over data-parallel groups that compute at different
speeds: a small integer program, modelled with cvxpy and solved with SCIP.

Pure. A *member* is one data-parallel group: the processes that read the same rows (a
tensor-parallel group of a dp x mp mesh, one process in plain data parallelism, the same
dp coordinate on every stage of a pipeline). The batch is shared out in *granules*: one
row, or with micro-batches one micro-batch (a member then runs its granules as its
micro-batches, each of the same size). Member g given ``u`` granules is busy, on each of
its processes k, ``fixed_k + per_unit_k * u`` seconds per step (the cost model's
estimate, linear in its share), and holds at most ``max_units`` granules in memory.

The program, with integer ``u_g >= 1``::

    minimise  T
    s.t.      fixed_k + per_unit_k * u_g <= T     for every process k of every member g
              sum_g u_g = U                        (the batch's granules)
              1 <= u_g <= max_units_g              (each device's memory)

and then, with ``T`` held at its optimum, the least busy member is made as busy as it
can be (maximise the smallest ``fixed_k + per_unit_k * u_g``): of the splits the slowest
member allows, the one whose members finish closest together. Where that still leaves a
choice (members whose time hardly depends on their share), a third solve takes the split
closest to shares in proportion to speed (``1 / per_unit`` of each member's slowest
process; even where no time depends on the share). A split that the devices' memory
cannot hold is a PlanError naming the devices before any solver runs.

Example::

    problem = SplitProblem(units=12, granule=1, members=(
        Member((0,), (0,), ((0.0, 1.0),)), Member((1,), (1,), ((0.0, 2.0),))))
    units, report = solve_split(problem)      # (8, 4): both busy 8 s
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from fractions import Fraction

from distgraph.errors import PlanError
from distgraph.units import fmt_ids

# seconds are scaled so that the busiest equal share is 1 before SCIP sees them
TOLERANCE = 1e-9


@dataclass(frozen=True)
class Member:
    """One data-parallel group: its processes, their devices (global ids), per process
    ``(fixed seconds, seconds per granule)``, and the most granules its memory holds
    (None: no limit)."""

    processes: tuple
    devices: tuple
    times: tuple
    max_units: int | None = None

    def busy(self, units: int) -> float:
        """Seconds its slowest process is busy with ``units`` granules."""
        return max(fixed + per_unit * units for fixed, per_unit in self.times)

    def least(self, units: int) -> float:
        """Seconds its least busy process is busy with ``units`` granules."""
        return min(fixed + per_unit * units for fixed, per_unit in self.times)


@dataclass(frozen=True)
class SplitProblem:
    """``units`` granules of ``granule`` rows to share out over ``members``."""

    units: int
    granule: int
    members: tuple

    def __post_init__(self):
        if self.units < 1 or self.granule < 1 or not self.members:
            raise PlanError(f"a batch split needs granules, rows per granule and members; "
                            f"got {self.units} granules of {self.granule} rows over "
                            f"{len(self.members)} members")
        for m in self.members:
            if not m.times or any(f < 0 or p < 0 or not math.isfinite(f + p)
                                  for f, p in m.times):
                raise PlanError(f"member {m.processes}: its busy times {m.times} must be "
                                "finite and >= 0")


@dataclass(frozen=True)
class SplitReport:
    """What SCIP said: the busiest and least busy member's seconds, the solver's
    status of each phase, and the seconds both took."""

    busiest: float
    least_busy: float
    status: str
    solve_time: float


@dataclass(frozen=True)
class BatchSplit:
    """Which rows of a global batch of ``batch`` rows each process reads.

    ``members`` are the data-parallel groups in the order of their coordinates along
    ``mesh_dims`` (the mesh dims that split the batch), each a tuple of process ids;
    ``units[g]`` is member g's number of granules of ``granule`` rows. Without
    micro-batches member g reads one run of rows, after member g-1's (the layout an
    even split ``S(0)`` has). With micro-batches (``micro_batched``) the granules are
    micro-batches, dealt in rounds: round r gives the next granule of the batch to each
    member that still has one, in member order; a member's micro-batch r is its granule
    of round r. An even split is then the layout of the even plan (micro-batch m
    is rows [m B/M, (m+1) B/M) of the batch, split over the members).

    Example: ``BatchSplit(12, 1, False, ("dp",), ((0,), (1,)), (8, 4)).rows(1)`` is
    ``((8, 12),)``.
    """

    batch: int
    granule: int
    micro_batched: bool
    mesh_dims: tuple
    members: tuple
    units: tuple
    predicted: tuple = ()
    report: SplitReport | None = None

    def __post_init__(self):
        if sum(self.units) * self.granule != self.batch or len(self.units) != len(self.members):
            raise PlanError(f"a batch split of {self.batch} rows: {list(self.units)} granules "
                            f"of {self.granule} rows over {len(self.members)} members do not "
                            "make the batch")

    def member_of(self, process: int) -> int:
        for g, procs in enumerate(self.members):
            if process in procs:
                return g
        raise PlanError(f"process {process} reads no rows of this batch split (members "
                        f"{[list(m) for m in self.members]})")

    def row_count(self, process: int) -> int:
        """Rows of the batch ``process`` reads."""
        return self.units[self.member_of(process)] * self.granule

    def micro_batches(self, process: int) -> int:
        """Micro-batches ``process`` runs per step (1 without micro-batches)."""
        return self.units[self.member_of(process)] if self.micro_batched else 1

    def rows(self, process: int) -> tuple:
        """``(start, stop)`` row ranges of the batch ``process`` reads, one per micro-batch
        in the order it runs them (one range without micro-batches)."""
        g = self.member_of(process)
        if not self.micro_batched:
            start = sum(self.units[:g]) * self.granule
            return ((start, start + self.units[g] * self.granule),)
        out, next_granule = [], 0
        for r in range(max(self.units)):
            for k, count in enumerate(self.units):
                if r < count:
                    if k == g:
                        out.append((next_granule * self.granule,
                                    (next_granule + 1) * self.granule))
                    next_granule += 1
        return tuple(out)

    def positions(self, process: int) -> tuple:
        """Where each micro-batch ``process`` runs sits in the batch, counted in the even
        split's micro-batches of ``len(members) * granule`` rows: its rows start
        ``position * micro-batch rows`` after those it holds of the even split's
        micro-batch 0 (even: 0, 1, 2, ...). Fractions; ``(0,)`` without micro-batches."""
        if not self.micro_batched:
            return (Fraction(0),)
        g, n = self.member_of(process), len(self.members)
        return tuple(Fraction(start // self.granule - g, n) for start, _ in self.rows(process))

    @property
    def is_even(self) -> bool:
        return len(set(self.units)) == 1

    def to_dict(self) -> dict:
        return {"batch": self.batch, "granule": self.granule,
                "micro_batched": self.micro_batched, "mesh_dims": list(self.mesh_dims),
                "members": [{"processes": list(m), "units": u, "rows": u * self.granule,
                             "predicted_busy": p if p is None else float(p)}
                            for m, u, p in zip(self.members, self.units,
                                               self.predicted or (None,) * len(self.units))]}

    def summary(self) -> str:
        """Two lines for ``Plan.explain()``: the split, and the members' rows (fewest and
        most, with the processes of each) and predicted busy seconds; ``str`` lists every
        member."""
        unit = "micro-batches of" if self.micro_batched else "runs of"
        rows = [u * self.granule for u in self.units]
        least, most = rows.index(min(rows)), rows.index(max(rows))
        lines = [f"batch split over {', '.join(self.mesh_dims)}: {self.batch} rows in {unit} "
                 f"{self.granule} row(s) over {len(self.members)} members"
                 + (" (even)" if self.is_even else "")]
        if not self.is_even:
            lines.append(f"  fewest rows {rows[least]} (processes "
                         f"{fmt_ids(self.members[least], limit=3)}), most {rows[most]} "
                         f"(processes {fmt_ids(self.members[most], limit=3)})")
        if self.predicted:
            lines.append(f"  predicted busy {min(self.predicted) * 1e3:.4g} to "
                         f"{max(self.predicted) * 1e3:.4g} ms"
                         + (f"; SCIP {self.report.status} in {self.report.solve_time:.3f} s"
                            if self.report is not None else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        unit = "micro-batches of" if self.micro_batched else "runs of"
        lines = [f"batch split over {', '.join(self.mesh_dims)}: {self.batch} rows in "
                 f"{unit} {self.granule} row(s)" + (" (even)" if self.is_even else "")]
        for g, (procs, u) in enumerate(zip(self.members, self.units)):
            where = (f"{u} micro-batches" if self.micro_batched else
                     "rows {}-{}".format(*self.rows(procs[0])[0]))
            busy = (f", busy {self.predicted[g] * 1e3:.3f} ms" if self.predicted else "")
            lines.append(f"  processes {', '.join(map(str, procs))}: {u * self.granule} rows "
                         f"({where}{busy})")
        if self.report is not None:
            r = self.report
            lines.append(f"  SCIP {r.status} in {r.solve_time:.3f} s")
        return "\n".join(lines)


def check_memory(problem: SplitProblem) -> None:
    """PlanError naming the devices when their memory cannot hold the batch: a member
    that holds no granule, or all members together fewer than the batch's."""
    what = f"granule of {problem.granule} rows" if problem.granule > 1 else "row"
    for m in problem.members:
        if m.max_units is not None and m.max_units < 1:
            raise PlanError(f"devices {list(m.devices)} (processes {list(m.processes)}) do not "
                            f"have the memory for one {what} of the batch beside their "
                            "parameters and states; shard the model further, or leave these "
                            "devices out of the data-parallel group")
    if all(m.max_units is not None for m in problem.members):
        held = sum(m.max_units for m in problem.members)
        if held < problem.units:
            each = ", ".join(f"devices {list(m.devices)}: {m.max_units * problem.granule}"
                             for m in problem.members)
            raise PlanError(f"the devices' memory holds {held * problem.granule} rows of the "
                            f"batch's {problem.units * problem.granule} ({each}); use a "
                            "smaller batch, more micro-batches, or more devices")


def solve_split(problem: SplitProblem, time_limit: float = 60.0) -> tuple[tuple, SplitReport]:
    """(granules per member, report) of the balanced split (see the module docstring)."""
    import cvxpy as cp     # ~1 s to import: only plans that balance pay it

    check_memory(problem)
    members = problem.members
    n = len(members)
    scale = max(m.busy(problem.units / n) for m in members) or 1.0
    u = cp.Variable(n, integer=True)
    base = [u >= 1, cp.sum(u) == problem.units]
    base += [u[g] <= m.max_units for g, m in enumerate(members) if m.max_units is not None]
    start = time.perf_counter()
    busiest = cp.Variable()
    slowest = [(f / scale) + (p / scale) * u[g] <= busiest
               for g, m in enumerate(members) for f, p in m.times]
    first = cp.Problem(cp.Minimize(busiest), base + slowest)
    status = _solve(first, time_limit)
    if busiest.value is None:
        raise PlanError(f"SCIP found no batch split within {time_limit:g} s; raise "
                        "Strategy(solver_time_limit=...)")
    top = busiest.value * (1 + TOLERANCE) + TOLERANCE
    least = cp.Variable()
    together = [(f / scale) + (p / scale) * u[g] <= top
                for g, m in enumerate(members) for f, p in m.times]
    together += [(f / scale) + (p / scale) * u[g] >= least
                 for g, m in enumerate(members) for f, p in m.times]
    second = cp.Problem(cp.Maximize(least), base + together)
    statuses = [status, _solve(second, time_limit)]
    if least.value is None:
        raise PlanError(f"SCIP found no batch split within {time_limit:g} s; raise "
                        "Strategy(solver_time_limit=...)")
    floor = least.value * (1 - TOLERANCE) - TOLERANCE
    closest = [(f / scale) + (p / scale) * u[g] <= top
               for g, m in enumerate(members) for f, p in m.times]
    closest += [(f / scale) + (p / scale) * u[g] >= floor
                for g, m in enumerate(members) for f, p in m.times]
    third = cp.Problem(cp.Minimize(cp.sum(cp.abs(u - ideal_shares(problem)))), base + closest)
    statuses.append(_solve(third, time_limit))
    if u.value is None:
        raise PlanError(f"SCIP found no batch split within {time_limit:g} s; raise "
                        "Strategy(solver_time_limit=...)")
    units = tuple(int(round(x)) for x in u.value)
    report = SplitReport(max(m.busy(k) for m, k in zip(members, units)),
                         min(m.least(k) for m, k in zip(members, units)),
                         statuses[0] if len(set(statuses)) == 1 else ", ".join(statuses),
                         time.perf_counter() - start)
    return units, report


def ideal_shares(problem: SplitProblem) -> list[float]:
    """Granules per member in proportion to its speed (one over its slowest process's
    seconds per granule), the batch's in all; even where no member's time depends on
    its share."""
    slowest = [max(p for _, p in m.times) for m in problem.members]
    top = max(slowest)
    if top <= 0:
        return [problem.units / len(slowest)] * len(slowest)
    speeds = [1.0 / max(p, top * 1e-6) for p in slowest]
    return [problem.units * v / sum(speeds) for v in speeds]


def _solve(problem, time_limit: float) -> str:
    import cvxpy as cp

    problem.solve(solver=cp.SCIP, scip_params={"limits/time": float(time_limit)})
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE, cp.USER_LIMIT):
        raise PlanError(f"the batch-split program came back {problem.status!r} from SCIP; "
                        "please report it with the plan")
    return "optimal" if problem.status == cp.OPTIMAL else "time_limit"
