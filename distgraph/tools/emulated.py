"""``distgraph cluster calibrate --emulate FILE -n N -o OUT``: measure an emulated cluster.

Runs the calibration script (:mod:`distgraph.tools.calibrate`: GEMM GFLOP/s per rank, a
ping-pong per pair of ranks, an all-reduce) on N ranks of the emulated FILE and writes
OUT with FILE's machines (ids, hostnames) and device global ids — rank r measured FILE's
r-th device — and the measured figures: each device's GFLOP/s, memory bandwidth, op
launch cost, per-op-type costs and reshard software costs, and one link per pair of
devices with its measured bandwidth and latency (``SHM`` inside a machine, ``NET``
between machines). Type, model and memory stay FILE's, so OUT has FILE's device meshes
and plans like FILE. With N below FILE's device count, OUT holds the measured devices only
(and the machines that hold them).

Where a machine of FILE computes slower than the fastest (its ranks get a CPU quota),
GEMM rates are measured sustained (over :data:`GEMM_WINDOW` seconds, all ranks at once),
since a machine slowed by a quota computes at full speed for a moment at a time; so are
the whole steps that scale the per-op costs (:func:`~distgraph.tools.device_probe.
op_costs`), since a short step lined up alone often runs while ranks that share its
core have not woken yet. Without a quota the figures are the fastest runs times each
rank's share of a core, as on a real machine.
It then prints each machine's measured GEMM rate next to FILE's (as shares of the
machine FILE says is fastest), and, per pair of devices, FILE's link figures next to the
measured ones::

    machine  ranks  file GFLOP/s  file ratio  measured GFLOP/s  measured ratio  ratio/file
    node0    0      50            1           41.3              1               1.00
    node1    1      25            0.5         20.9              0.506           1.01
    pair  machines     file GB/s  measured GB/s  ratio  file us  measured us
    0-2   node0-node1  0.125      0.1172         0.94   100      48.3
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile

from distgraph.errors import DistGraphError
from distgraph.resources.cluster import Cluster, DeviceMesh, Link, Machine
from distgraph.runtime.emulate.launch import launch_emulated
from distgraph.runtime.emulate.layout import emulated_job
from distgraph.tools.calibrate import SCRIPT as CALIBRATE_SCRIPT

BANDWIDTH_TOLERANCE = 0.2
SPEED_TOLERANCE = 0.15
GEMM_WINDOW = 0.3            # seconds: 30 periods of the emulation's CPU quota


def relabel(measured: Cluster, source: Cluster, nprocs: int) -> Cluster:
    """The measured cluster (device r = rank r) in ``source``'s machines and global ids."""
    gid = [d.global_id for d in source.devices[:nprocs]]
    rank_of = {g: r for r, g in enumerate(gid)}
    figures = {d.global_id: d for d in measured.devices}
    links = [Link(gid[ln.source], gid[ln.target], ln.bandwidth, ln.latency, ln.type)
             for ln in measured.all_links]
    machine_of = {g: source.machine_of(g).id for g in gid}
    machines = []
    for m in source.machines:
        devices = tuple(_measured(d, m.id, figures[rank_of[d.global_id]])
                        for d in m.devices if d.global_id in rank_of)
        if devices:
            inside = tuple(ln for ln in links if machine_of[ln.source] == m.id ==
                           machine_of[ln.target])
            machines.append(Machine(m.id, m.hostname, devices, inside, addr=m.addr,
                                    port=m.port))
    between = [ln for ln in links if machine_of[ln.source] != machine_of[ln.target]]
    meshes = None
    if all(i in rank_of for mesh in source.device_meshes for i in mesh.ids):
        meshes = tuple(DeviceMesh(mesh.name, mesh.shape, mesh.ids)
                       for mesh in source.device_meshes)
    return Cluster(tuple(machines), tuple(between), device_meshes=meshes,
                   name=f"{source.name}_measured", calibration=measured.calibration,
                   figures="measured")


def _measured(d, machine: int, got):
    """``d`` (FILE's device) with the figures measured on its rank (``got``): GFLOP/s,
    memory bandwidth, op launch cost, per-op-type costs and per-step reshard software
    costs; identity, type, model, memory and its reserve stay FILE's."""
    return dataclasses.replace(got, global_id=d.global_id, local_id=d.local_id,
                               machine_id=machine, type=d.type, model=d.model,
                               memory=d.memory, reserved_memory=d.reserved_memory)


def comparison(source: Cluster, out: Cluster) -> tuple[str, list[float]]:
    """The file-vs-measured table, and the measured/file bandwidth ratio of every pair of
    devices on different machines."""
    header = ("pair", "machines", "file GB/s", "measured GB/s", "ratio", "file us",
              "measured us")
    rows, ratios = [], []
    host = {m.id: m.hostname for m in source.machines}
    for ln in sorted(out.all_links, key=lambda ln: (ln.source, ln.target)):
        a, b = ln.source, ln.target
        file_bw, file_lat = source.bandwidth(a, b), source.latency(a, b)
        ma, mb = source.machine_of(a).id, source.machine_of(b).id
        ratio = ln.bandwidth / file_bw
        if ma != mb:
            ratios.append(ratio)
        rows.append((f"{a}-{b}", host[ma] if ma == mb else f"{host[ma]}-{host[mb]}",
                     f"{file_bw:g}", f"{ln.bandwidth:.4g}", f"{ratio:.2f}", f"{file_lat:g}",
                     f"{ln.latency:.3g}"))
    within = sum(abs(r - 1) <= BANDWIDTH_TOLERANCE for r in ratios)
    return (_table(header, rows) + f"\nbetween machines, {within} of {len(ratios)} pairs "
            f"measure within {BANDWIDTH_TOLERANCE:.0%} of the file's bandwidth"), ratios


def speed_comparison(source: Cluster, out: Cluster) -> tuple[str, list[float]]:
    """The per-machine GEMM table (FILE's rate and share of its fastest machine of the
    job next to the measured ones), and each machine's measured share over FILE's."""
    dtype = _common_dtype(out.devices)
    measured_ids = {d.global_id for d in out.devices}
    rows = []
    for m in source.machines:
        ids = [d.global_id for d in m.devices if d.global_id in measured_ids]
        if not ids:
            continue
        file_rate = _mean(source.device(i).gflops.get(dtype, 0.0) for i in ids)
        rows.append((m.hostname, ids, file_rate, _mean(out.device(i).gflops[dtype] for i in ids)))
    ref = max(rows, key=lambda r: r[2])
    header = ("machine", "ranks", f"file GFLOP/s ({dtype})", "file ratio", "measured GFLOP/s",
              "measured ratio", "ratio/file")
    lines, shares = [], []
    for host, ids, file_rate, measured in rows:
        file_ratio = file_rate / ref[2] if ref[2] else 1.0
        measured_ratio = measured / ref[3]
        shares.append(measured_ratio / file_ratio)
        lines.append((host, ",".join(map(str, ids)), f"{file_rate:g}", f"{file_ratio:.3g}",
                      f"{measured:.4g}", f"{measured_ratio:.3g}", f"{shares[-1]:.2f}"))
    table = _table(header, lines)
    within = sum(abs(r - 1) <= SPEED_TOLERANCE for r in shares)
    table += (f"\n{within} of {len(shares)} machines compute within {SPEED_TOLERANCE:.0%} of "
              "the file's speed ratio")
    return table, shares


def _common_dtype(devices) -> str:
    common = set.intersection(*(set(d.gflops) for d in devices))
    return "float32" if "float32" in common else sorted(common)[0]


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def _table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header, *rows])


def calibrate_command_emulated(args) -> int:
    """The handler of ``distgraph cluster calibrate --emulate FILE -n N -o OUT``."""

    prog = "distgraph cluster calibrate"
    try:
        source = Cluster.from_file(args.emulate)
        with tempfile.TemporaryDirectory(prefix="distgraph-calibrate-") as tmp:
            raw = os.path.join(tmp, "measured.yaml")
            # sustained windows only where a quota makes them needed: elsewhere the
            # fastest runs times the core share hold (and a window's one timing per
            # GEMM shape makes the curve's fit wander: 4 ranks on 2 cores priced a
            # GPT's matmuls at 51-61 ms with windows, 59-61 without, 64 measured)
            window = ["--gemm-window", str(GEMM_WINDOW)] if emulated_job(
                source, args.nprocs, "calibrate", "10.0.0").throttled else []
            rc = launch_emulated(args.emulate, args.nprocs,
                                 [CALIBRATE_SCRIPT, "-o", raw, "--repeats", str(args.repeats),
                                  *window], timeout=args.timeout)
            if rc != 0:
                print(f"{prog}: the measuring ranks failed (exit code {rc}); see their output "
                      "above", file=sys.stderr)
                return rc
            measured = Cluster.from_file(raw)
        out = relabel(measured, source, args.nprocs)
        out.save(args.output)
    except DistGraphError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {source.name!r} measured on {args.nprocs} emulated ranks")
    print(speed_comparison(source, out)[0])
    print(comparison(source, out)[0])
    return 0
