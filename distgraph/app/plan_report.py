"""The report ``distgraph plan`` prints: a Plan as plain data with its estimate and a
per-layer summary of its layouts, written by the first Engine call of a script run under
``distgraph plan`` (see :mod:`distgraph.cli.plan`), or why that call could not plan.

The command's request (where the report goes, where the plan's picture goes when
``--plot`` asked for one) reaches an Engine through the launch context
(:func:`distgraph.runtime.launch.context.current`: a :class:`PlanRequest`), which the
Engine reads once, when it is created; once the report is written the Engine raises
:class:`PlanReported` and the bootstrap that runs the script ends it there.

The plan's page (``Plan.report``: ``distgraph plan --report PAGE``, and ``distgraph run
--report PAGE``, written by rank 0 before training and, with ``Strategy(profile=True)``,
again after each fit with what the run measured) shows the same estimate:
:func:`priced`, :func:`write_page`, :func:`write_run_page`.
"""

from __future__ import annotations

import json
import os
import tempfile

from distgraph.errors import DistGraphError, TooFewDevicesError
from distgraph.passes.cost.estimate import estimate
from distgraph.plan.export import TARGETS
from distgraph.plan.figures import calibrated
from distgraph.resources.cluster import Cluster
from distgraph.runtime.launch.context import PlanReported, PlanRequest

__all__ = ["PlanReported", "PlanRequest", "layer_summary", "priced", "report",
           "write_checked", "write_failure", "write_page", "write_report", "write_run_page"]


def priced(plan, cluster=None) -> tuple:
    """(the estimate, the cluster it was made on, why there is none) of ``plan``: the
    plan's own (made on its own cluster: None), else one made on ``cluster`` where it
    holds the plan's processes, else on the plan's cluster, else on this machine as the
    plan's processes."""
    if plan.estimate is not None:
        return plan.estimate, None, None
    on = cluster if cluster is not None and len(cluster.devices) >= plan.world_size \
        else plan.cluster or Cluster.local(plan.world_size)
    try:
        return estimate(plan, on), on, None
    except DistGraphError as e:
        return None, on, str(e)


def report(plan, cluster=None, pricing=None) -> dict:
    """The plan as plain data with its estimate (:func:`priced` on ``cluster``; given:
    ``pricing``), the per-layer op summary, and two texts: ``text``, ``plan.explain()``
    (the summary ``distgraph plan`` prints), and ``full_text``, ``plan.explain(full=True)``
    with the per-layer summary (``--full``); ``export``: :func:`exports`; ``calibrated``:
    whether the cluster the times were priced on gives measured figures."""
    data = plan.to_dict()
    data["layers"] = layer_summary(plan)
    est, priced_on, error = pricing or priced(plan, cluster)
    if error is not None:
        data["estimate_error"] = error
    elif plan.estimate is None:
        data["estimate"] = est.to_dict()
    data["export"] = exports(plan)
    # whether the times were priced on measured figures (Cluster.calibrated)
    data["calibrated"] = calibrated(priced_on if priced_on is not None else plan.cluster)
    data["text"] = plan.explain(estimate=est, cluster=priced_on)
    data["full_text"] = "\n".join([plan.explain(full=True, estimate=est),
                                   *_summary_lines(data["layers"])])
    return data


def exports(plan) -> dict:
    """{target: ``plan.export(target)``, or {"error": why it cannot}} for torchtitan
    and Megatron-LM (``distgraph plan --export``)."""
    out = {}
    for target in TARGETS:
        try:
            out[target] = plan.export(target)
        except DistGraphError as e:
            out[target] = {"error": str(e)}
    return out


def layer_summary(plan) -> dict:
    """{layer: ["matmul [x, None] x [None, None] -> [x, None] (x2)", ...]}: the distinct
    layouts of each layer's forward ops, in program order."""
    out: dict = {}
    for op in plan.program.ops:
        if op.role not in ("forward", "loss"):
            continue
        da = op.dist_attr
        line = (f"{op.type} " + " x ".join(map(str, da.input_specs)) + " -> "
                + ", ".join(map(str, da.output_specs)) + f" on {list(da.mesh.process_ids)}")
        lines = out.setdefault(op.layer or "(model)", {})
        lines[line] = lines.get(line, 0) + 1
    return {layer: [f"{line} (x{n})" if n > 1 else line for line, n in lines.items()]
            for layer, lines in out.items()}


def _summary_lines(layers: dict) -> list:
    lines = ["forward op layouts per layer:"]
    for layer, ops in layers.items():
        lines.append(f"  {layer}:")
        lines += [f"    {line}" for line in ops]
    return lines


def write_page(plan, path, cluster=None, pricing=None, timeline=None) -> None:
    """Write ``plan``'s page (``Plan.report``) to ``path``, with its estimate as
    :func:`priced` makes it on ``cluster`` (given: ``pricing``) and a run's
    ``timeline``."""
    est, priced_on, _ = pricing or priced(plan, cluster)
    plan.report(path, estimate=est, cluster=priced_on, timeline=timeline)


def write_run_page(engine, plan, measured: bool = False) -> None:
    """Under ``distgraph run --report PAGE`` (``engine.page_request``), rank 0 writes the
    training ``plan``'s page there (its estimate as :func:`priced` makes it on the launch
    cluster); with ``measured``, after a fit under ``Strategy(profile=True)``, again with
    the run's timeline (gathered from every rank: a collective). A page that cannot be
    written is a warning: the training goes on."""
    path = engine.page_request
    if path is None or (measured and not engine.strategy.profile):
        return
    timeline = engine.timeline() if measured else None
    if engine.rank != 0:
        return
    try:
        write_page(plan, path, engine.launch_cluster(), timeline=timeline)
    except (DistGraphError, OSError) as e:
        engine.warn(f"the plan's page was not written to {path}: {e}")


def write_report(plan, request: PlanRequest, cluster=None) -> None:
    """Write ``report(plan)`` to ``request.out`` (and the plan's picture to
    ``request.plot``, its plan file to ``request.save``, its page to ``request.page``)
    unless another process already did (the first complete report wins; readers never
    see a partial file, and the picture, the plan file and the page are there before the
    report)."""
    pricing = priced(plan, cluster)
    data = report(plan, cluster, pricing)
    if request.save:
        try:
            plan.save(request.save)
            data["saved"] = {"path": request.save, "bytes": os.path.getsize(request.save)}
        except (DistGraphError, OSError) as e:
            data["save_error"] = str(e)
    if request.plot:
        try:
            plan.plot(request.plot)
        except DistGraphError as e:
            data["plot_error"] = str(e)
    if request.page:
        try:
            write_page(plan, request.page, cluster, pricing)
            data["page"] = {"path": request.page, "bytes": os.path.getsize(request.page)}
        except (DistGraphError, OSError) as e:
            data["page_error"] = str(e)
    _publish(data, request.out)


def write_checked(request: PlanRequest) -> None:
    """Say that the Engine's plan file was made for the script's program and cluster
    (``distgraph run --plan`` asks it before any rank starts: ``request.check``)."""
    _publish({"checked": True}, request.out)


def write_failure(error: DistGraphError, request: PlanRequest) -> None:
    """Write why planning failed (``{"error": "PlanError: ..."}``) to ``request.out``
    unless a report is there already: ``distgraph plan`` prints it instead of a plan. A
    plan too big for the cluster also gives its ``processes``, as a report does."""
    data = {"error": f"{type(error).__name__}: {error}"}
    if isinstance(error, TooFewDevicesError):
        data["processes"] = error.process_ids
    _publish(data, request.out)


def _publish(data: dict, path: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".part")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)
