"""What the command that started a script asks of its Engines: the launch context.

``distgraph run --cluster FILE`` asks that an Engine made without a cluster use FILE's,
``distgraph run --plan PATH`` that an Engine made without a plan file use PATH's plan,
``distgraph run --report PAGE`` that rank 0 write its training plan's report there;
``distgraph plan [--cluster FILE | -n N] [--plot PNG] [--save PATH] [--report PAGE]`` asks
the first Engine call that plans a batch to write the plan's report (and picture, plan
file and page) and to end the script there. The
request travels as **arguments**: the command gives it to the per-rank bootstrap
(``python -m distgraph.runtime.launch.bootstrap --cluster FILE --plan-out PATH ...
script.py``, :meth:`LaunchContext.argv`), the bootstrap opens the context around the
script's run (:func:`opened`, a :mod:`contextvars` value; what its options leave out is
what the process inherited), and an Engine reads it through this one function,
:func:`current`, once, when it is made. The plan-only stop is
:class:`PlanReported`, which the bootstrap catches.

Why this shape:

- An argument at each hop and one reader: what a rank was asked is in its command line,
  and a test or a tool opens a context in-process (``with opened(LaunchContext(...))``)
  instead of setting process-wide variables.
- Processes a script starts itself (a conductor that starts its ranks with
  :func:`~distgraph.runtime.launch.launcher.launch`, which forwards the context as the
  bootstrap's arguments again, or a plain ``subprocess`` child, which nothing can give
  arguments to) inherit the request through the environment: the bootstrap exports it
  (:meth:`LaunchContext.environ`; ``$DISTGRAPH_CLUSTER`` is also what scripts read for
  their own ``Cluster.from_file``), and :func:`current` reads it there only when no
  context was opened in this process.
- :class:`PlanReported` is an exception of its own, not ``SystemExit``: the bootstrap
  ends the script with exit code 0 on it, and nothing else mistakes it for an exit. It
  derives from ``BaseException``, as ``SystemExit`` does, so a script's
  ``except Exception`` does not swallow it. A plain child process (no bootstrap) ends on
  it with its traceback, once its report is written: the command reads the report and
  stops the script.

Example::

    with opened(LaunchContext(cluster="resources/clusters/local4.yaml")):
        engine = dg.Engine(model, loss, optimizer)    # engine.cluster: local4.yaml's
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass

from distgraph.runtime.launch.status import CLUSTER_VAR

PLAN_OUT = "DISTGRAPH_PLAN_OUT"         # distgraph plan: where the report goes
PLAN_PLOT = "DISTGRAPH_PLAN_PLOT"       # distgraph plan --plot: where the picture goes
PLAN_SAVE = "DISTGRAPH_PLAN_SAVE"       # distgraph plan --save: where the plan file goes
PLAN_PAGE = "DISTGRAPH_PLAN_PAGE"       # distgraph plan --report: where the page goes
PLAN_FILE = "DISTGRAPH_PLAN_FILE"       # distgraph run --plan: the plan file to run
PLAN_CHECK = "DISTGRAPH_PLAN_CHECK"     # distgraph run --plan: check the file, plan nothing
REPORT = "DISTGRAPH_REPORT"             # distgraph run --report: where rank 0 writes the page
RESTART = "DISTGRAPH_ELASTIC_RESTART"   # distgraph run --elastic: which start this is
OPTIONS = {"--cluster": "cluster", "--plan-out": "plan_out", "--plan-plot": "plan_plot",
           "--plan-save": "plan_save", "--plan-page": "plan_page",
           "--plan-file": "plan_file",
           "--plan-check": "plan_check", "--report": "report",
           "--elastic-restart": "restart"}


@dataclass(frozen=True)
class PlanRequest:
    """What ``distgraph plan`` asks: the report's path, the picture's (None: no
    picture), the plan file's (``--save``; None: none), the page's (``--report``,
    ``Plan.report``; None: none). ``check``: what ``distgraph run --plan`` asks before
    any rank starts, only that the Engine's plan file be checked against the script's
    program and cluster (the report says so, or why not), without planning."""

    out: str
    plot: str | None = None
    save: str | None = None
    check: bool = False
    page: str | None = None


@dataclass(frozen=True)
class LaunchContext:
    """The request a script runs under: ``cluster``, the path of the resource file an
    Engine without a cluster uses; ``plan``, what ``distgraph plan`` asks (None: run);
    ``restart``, in an elastic job (``distgraph run --elastic``), which start of the
    script this is (0: the first; k: after the k-th failure), None outside one;
    ``plan_file``, the plan file an Engine made without one runs (``distgraph run
    --plan``); ``report``, where rank 0 writes the page of its training plan
    (``distgraph run --report``: ``Plan.report``)."""

    cluster: str | None = None
    plan: PlanRequest | None = None
    restart: int | None = None
    plan_file: str | None = None
    report: str | None = None

    def argv(self) -> list:
        """The bootstrap's options that carry this context (before the script)."""
        out = []
        for option, value in (("--cluster", self.cluster),
                              ("--plan-out", self.plan and self.plan.out),
                              ("--plan-plot", self.plan and self.plan.plot),
                              ("--plan-save", self.plan and self.plan.save),
                              ("--plan-page", self.plan and self.plan.page),
                              ("--plan-file", self.plan_file),
                              ("--report", self.report)):
            if value:
                out += [option, os.path.abspath(value)]
        if self.plan is not None and self.plan.check:
            out += ["--plan-check", "1"]
        if self.restart is not None:
            out += ["--elastic-restart", str(self.restart)]
        return out

    @classmethod
    def parse(cls, args: list, inherited: "LaunchContext | None" = None) -> tuple:
        """(the context, the rest) of bootstrap arguments ``[options] [--] script args``;
        what the options leave out is ``inherited``'s."""
        base = inherited or cls()
        found: dict = {"cluster": base.cluster, "plan_out": base.plan and base.plan.out,
                       "plan_plot": base.plan and base.plan.plot,
                       "plan_save": base.plan and base.plan.save,
                       "plan_page": base.plan and base.plan.page,
                       "plan_check": base.plan and base.plan.check and "1",
                       "restart": base.restart,
                       "plan_file": base.plan_file, "report": base.report}
        args = list(args)
        while args and args[0] in OPTIONS:
            if len(args) < 2:
                raise SystemExit(f"bootstrap: {args[0]} needs a value")
            if args[0] == "--plan-out":     # a request of its own: not an inherited plot
                found["plan_plot"] = found["plan_save"] = found["plan_check"] = None
                found["plan_page"] = None
            found[OPTIONS[args[0]]] = args[1]
            args = args[2:]
        if args and args[0] == "--":
            args = args[1:]
        return cls._of(found["cluster"], found["plan_out"], found["plan_plot"],
                       found["restart"], found["plan_save"], found["plan_file"],
                       found["plan_check"], found["report"], found["plan_page"]), args

    def environ(self) -> dict:
        """The variables that carry this context to processes the script starts."""
        values = {CLUSTER_VAR: self.cluster, PLAN_OUT: self.plan and self.plan.out,
                  PLAN_PLOT: self.plan and self.plan.plot,
                  PLAN_SAVE: self.plan and self.plan.save, PLAN_FILE: self.plan_file,
                  PLAN_PAGE: self.plan and self.plan.page,
                  PLAN_CHECK: self.plan and self.plan.check and "1", REPORT: self.report,
                  RESTART: None if self.restart is None else str(self.restart)}
        return {k: v for k, v in values.items() if v}

    @classmethod
    def inherited(cls, environ=None) -> "LaunchContext":
        """The context a process started by a launched script inherits (see the module
        docstring): read from ``environ`` (default: this process's environment)."""
        env = os.environ if environ is None else environ
        return cls._of(env.get(CLUSTER_VAR), env.get(PLAN_OUT), env.get(PLAN_PLOT),
                       env.get(RESTART), env.get(PLAN_SAVE), env.get(PLAN_FILE),
                       env.get(PLAN_CHECK), env.get(REPORT), env.get(PLAN_PAGE))

    @classmethod
    def _of(cls, cluster, plan_out, plan_plot, restart=None, plan_save=None,
            plan_file=None, plan_check=None, report=None,
            plan_page=None) -> "LaunchContext":
        plan = PlanRequest(plan_out, plan_plot or None, plan_save or None,
                           plan_check == "1", plan_page or None) if plan_out else None
        restart = int(restart) if restart not in (None, "") else None
        return cls(cluster or None, plan, restart, plan_file or None, report or None)


class PlanReported(BaseException):
    """Ends a script run under ``distgraph plan`` once its report is written; the
    bootstrap catches it and the script ends with exit code 0 (module docstring)."""


_CURRENT: contextvars.ContextVar = contextvars.ContextVar("distgraph_launch", default=None)


def current() -> LaunchContext:
    """The launch context this script runs under: the one the bootstrap (or a caller of
    :func:`opened`) opened, else the one this process inherited, else an empty one."""
    opened_here = _CURRENT.get()
    return opened_here if opened_here is not None else LaunchContext.inherited()


@contextlib.contextmanager
def opened(context: LaunchContext):
    """Run the block under ``context`` (what :func:`current` returns inside it)."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)
