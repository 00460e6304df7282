"""``Plan.report(path)``: the plan as one page a browser opens from disk.

One self-contained HTML file: its styles, its script (:mod:`.page`: plain SVG drawn by a
small script of its own, nothing fetched) and the plan's figures as JSON, all inline.
It shows

- the key figures: the predicted step time as compute + communication + bubble of the
  busiest process, model TFLOP/s per device and MFU, the largest peak against the
  device's memory (what ``explain()``'s first lines say);
- the cluster as its resource graph: its machines with their devices, each device
  coloured by the stage whose process runs on it, and the links inside and between the
  machines by bandwidth (a cluster of many machines as a grid of them, its links as
  classes);
- the pipeline schedule as a timeline per stage (:mod:`.report_lanes`): each forward,
  backward, input- and weight-gradient action per micro-batch at the seconds the
  estimate gives its task (its communication shaded), the update, and the idle time
  between them (the bubble); and, given the runtime's timeline of a run, what it
  measured;
- memory per group of alike processes as stacked bars (parameters, optimizer states,
  gradients, activations, the running kernel's workspace: the parts of the estimate's
  peak) against what a device may
  hold (its usable memory: its memory less its reserve, at most
  ``Strategy(memory_budget_gb)``) and its memory, in decimal bytes as ``explain()``;
- each stage's step split into compute, communication and bubble, with its model FLOP/s
  per device and MFU;
- the memory savers the search chose and each alternative it priced, the strategy, the
  cluster and the search's summary.

Every figure comes from the plan and its estimate as they are (processes alike are
estimated once and shown as one group, as ``explain()`` groups them); nothing is priced
again. Numbers the page prints carry their exact value in a ``data-value`` attribute.

Example::

    plan.report("plan.html")                          # open it in a browser
    plan.report("run.html", timeline=engine.timeline())   # with what a run measured
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import tempfile
from importlib import resources

from distgraph.errors import DistGraphError
from distgraph.plan.explain import Summary, holdings, layout
from distgraph.plan.report_lanes import measured, predicted
from distgraph.units import fmt_ids
from distgraph.version import __version__

MEMORY_GROUPS = 48       # bars of alike processes at most; the rest counted
GRID_MACHINES = 32       # clusters of more machines are drawn as a grid, links as classes


def write_report(plan, path, estimate=None, cluster=None, timeline=None) -> None:
    """Write ``plan``'s page to ``path`` (module docstring), atomically: a reader sees
    the old file or the whole new one. ``estimate`` / ``cluster``: those to show where
    the plan has none; ``timeline``: a run's (``engine.timeline()``, or the path of the
    Chrome trace ``Timeline.save`` wrote) to show beside the prediction."""
    page = render(report_data(plan, estimate, cluster, timeline))
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".report-", suffix=".part")
    except OSError as e:
        raise DistGraphError(f"cannot write the plan's report to {path}: {e.strerror} "
                             f"({folder}); give a path in a folder you can write") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def render(data: dict) -> str:
    """The page: ``data`` (:func:`report_data`) inline, with the styles and the script."""
    assets = resources.files("distgraph.plan").joinpath("page")
    style = assets.joinpath("report.css").read_text(encoding="utf-8")
    script = assets.joinpath("report.js").read_text(encoding="utf-8")
    # "</" would end the script element early; JSON reads "<\/" as "</"
    payload = json.dumps(data, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(data['title'])}</title>\n<style>\n{style}</style></head>\n"
            f"<body><noscript>This page draws the plan with its script: allow scripts."
            f"</noscript>\n<main id=\"report\"></main>\n"
            f"<script type=\"application/json\" id=\"plan-data\">{payload}</script>\n"
            f"<script>\n{script}</script>\n</body></html>\n")


def report_data(plan, estimate=None, cluster=None, timeline=None) -> dict:
    """What the page shows, as plain data (module docstring)."""
    facts = Summary(plan, estimate, cluster)
    est = facts.estimate
    return {
        "title": f"distgraph plan: {plan.world_size:,} process"
                 f"{'es' if plan.world_size != 1 else ''}, {len(plan.stages)} stage"
                 f"{'s' if len(plan.stages) != 1 else ''}",
        "version": __version__,
        "head": facts.head(),
        "fits": facts.fits()[0],
        "totals": _totals(facts),
        "stages": [_stage(facts, s, mesh) for s, mesh in enumerate(plan.stages)],
        "memory": _memory(facts),
        "predicted": predicted(plan, est) if est is not None else None,
        "measured": measured(plan, timeline) if timeline is not None else None,
        "savers": [_saver(c) for c in plan.savers],
        "strategy": _strategy(plan.strategy),
        "cluster": _cluster(facts) if facts.cluster is not None else None,
        "describe": facts.cluster.describe() if facts.cluster is not None else None,
        "search": plan.search.summary() if plan.search is not None else None,
    }


def _totals(facts) -> dict:
    plan, est = facts.plan, facts.estimate
    out = {"processes": plan.world_size, "stages": len(plan.stages),
           "micro_batches": plan.micro_batches, "schedule": plan.order.name,
           "flops": facts.flops, "dtype": facts.dtype}
    if est is None:
        return out
    figures = facts.memory_figures()
    out.update(step_time=est.step_time, compute=est.compute,
               communication=est.communication, bubble=est.bubble,
               peak_memory=figures["peak"], usable_memory=figures["usable"],
               device_memory=figures["device"])
    if est.step_time:
        out["per_device"], out["mfu"] = facts.rates(facts.flops, plan.process_ids)
    return out


def _stage(facts, s: int, mesh) -> dict:
    """Stage ``s``: where it runs, what it holds, its busiest process's step and its
    model FLOP/s per device and MFU."""
    plan, est = facts.plan, facts.estimate
    pids = list(mesh.process_ids)
    out = {"index": s, "mesh": list(mesh.shape), "dims": list(mesh.dim_names),
           "where": facts.where(pids), "layout": layout(plan, mesh),
           "holds": holdings(plan, mesh), "flops": facts.stage_flops[s]}
    mine = [p for p in est.processes if p.stage == s] if est is not None else []
    if mine:
        busiest = max(mine, key=lambda p: p.compute + p.communication)
        out.update(process=busiest.process, compute=busiest.compute,
                   communication=busiest.communication,
                   bubble=max(est.step_time - busiest.compute - busiest.communication, 0.0))
        if est.step_time:
            out["per_device"], out["mfu"] = facts.rates(facts.stage_flops[s], pids)
    return out


def _memory(facts) -> dict:
    """Groups of processes alike in stage, memory and device, each with the parts of its
    peak, what its device may hold and the device's memory (bytes): the MEMORY_GROUPS
    with the largest peaks, in stage order."""
    est = facts.estimate
    if est is None:
        return {"groups": [], "hidden": 0}
    groups: dict = {}
    for p in est.processes:
        # what a device may hold: the limit the planner fits plans to
        key = (p.stage, p.parameters, p.states, p.gradients, p.activations, p.workspace,
               facts.memory(p.process), facts.usable(p.process))
        groups.setdefault(key, []).append(p.process)
    shown = set(sorted(groups, key=lambda k: -sum(k[1:6]))[:MEMORY_GROUPS])
    out = []
    for key in sorted(shown, key=lambda k: (k[0], min(groups[k]))):
        stage, params, states, grads, acts, work, memory, usable = key
        out.append({"stage": stage, "processes": fmt_ids(groups[key], limit=4),
                    "count": len(groups[key]), "parameters": params, "states": states,
                    "gradients": grads, "activations": acts, "workspace": work,
                    "peak": params + states + grads + acts + work, "memory": memory,
                    "usable": usable})
    return {"groups": out, "hidden": len(groups) - len(out)}


def _saver(choice) -> dict:
    """A saver's choice as data, with its words: the first line, and the notes between it
    and the alternatives' lines (why none was priced; what each stage got)."""
    lines = choice.lines()
    return dict(choice.to_dict(), head=lines[0],
                notes=[line.strip() for line in lines[1:len(lines) - len(choice.others)]])


def _strategy(strategy) -> list:
    """[name, value, whether it differs from the default] of every Strategy field."""
    out = []
    for f in dataclasses.fields(strategy):
        value = getattr(strategy, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append([f.name, _plain(value), value != default])
    return out


def _plain(value):
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return str(value)


def _cluster(facts) -> dict:
    """The resource graph as the page draws it: machines with their devices (each with
    the process and stage it runs, -1: none), switches, and the links between nodes by
    bandwidth; past GRID_MACHINES machines, no single link, their classes only."""
    plan, cluster = facts.plan, facts.cluster
    stage_of = facts.stage_of
    on_device: dict = {}
    devices = cluster.devices
    for pid in plan.process_ids:
        rank = plan.ranks(pid)
        if rank < len(devices):
            on_device[devices[rank].global_id] = pid
    machine_of, machines = {}, []
    for m in cluster.machines:
        ids = [d.global_id for d in m.devices]
        procs = [on_device.get(g, -1) for g in ids]
        machines.append({"id": m.id, "host": m.hostname, "devices": ids,
                         "models": sorted({f"{d.type} {d.model}".strip() for d in m.devices}),
                         "memory": sorted({d.memory for d in m.devices}),
                         "processes": procs,
                         "stages": [stage_of.get(q, -1) if q >= 0 else -1 for q in procs]})
        for node in m.devices + tuple(m.nics):
            machine_of[node.global_id] = m.id
    inside = [ln for m in cluster.machines for ln in m.links]
    classes: dict = {}
    for scope, links in (("inside", inside), ("between", cluster.links)):
        for ln in links:
            key = (scope, ln.type or "-", ln.bandwidth, ln.latency)
            classes[key] = classes.get(key, 0) + 1
    out = {"name": cluster.name, "machines": machines,
           "switches": [s.global_id for s in cluster.switches],
           "classes": [{"scope": k[0], "type": k[1], "bandwidth": k[2], "latency": k[3],
                        "count": n} for k, n in classes.items()],
           "links": None}
    if len(machines) <= GRID_MACHINES:
        out["links"] = [[ln.source, ln.target, ln.bandwidth, machine_of.get(ln.source, -1),
                         machine_of.get(ln.target, -1)] for ln in inside + list(cluster.links)]
        out["nics"] = {str(n.global_id): machine_of[n.global_id]
                       for m in cluster.machines for n in m.nics}
    return out
