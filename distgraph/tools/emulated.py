"""``distgraph cluster calibrate --emulate FILE -n N -o OUT``: measure an emulated cluster.

Runs the calibration script (``resources/calibrate.py``: GEMM GFLOP/s per rank, a
ping-pong per pair of ranks, an all-reduce) on N ranks of the emulated FILE and writes
OUT with FILE's machines (ids, hostnames) and device global ids — rank r measured FILE's
r-th device — and the measured figures: each device's GFLOP/s, memory bandwidth, op
launch cost, per-op-type costs and reshard software costs, and one link per pair of
devices with its measured bandwidth and latency (``SHM`` inside a machine, ``NET``
between machines). Type, model and memory stay FILE's, so OUT has FILE's device meshes
and plans like FILE. With N below FILE's device count, OUT holds the measured devices only
(and the machines that hold them).

It then prints, per pair of devices, FILE's figure next to the measured one::

    pair  machines     file GB/s  measured GB/s  ratio  file us  measured us
    0-2   node0-node1  0.125      0.1172         0.94   100      48.3
"""

from __future__ import annotations

import os
import sys
import tempfile

from distgraph.errors import DistGraphError
from distgraph.resources.cluster import Cluster, Device, DeviceMesh, Link, Machine
from distgraph.runtime.emulate.launch import launch_emulated
from distgraph.tools.calibrate import SCRIPT as CALIBRATE_SCRIPT

BANDWIDTH_TOLERANCE = 0.2


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
                   name=f"{source.name}_measured", calibration=measured.calibration)


def _measured(d: Device, machine: int, got: Device) -> Device:
    """``d`` (FILE's device) with the figures measured on its rank: GFLOP/s, memory
    bandwidth, op launch cost, per-op-type costs and per-step reshard software costs."""
    return Device(d.global_id, d.local_id, machine, d.type, d.model, got.gflops, d.memory,
                  got.memory_bandwidth, got.op_overhead, got.op_costs, got.reshard_overhead)


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
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()
             for r in [header, *rows]]
    within = sum(abs(r - 1) <= BANDWIDTH_TOLERANCE for r in ratios)
    lines.append(f"between machines, {within} of {len(ratios)} pairs measure within "
                 f"{BANDWIDTH_TOLERANCE:.0%} of the file's bandwidth")
    return "\n".join(lines), ratios


def calibrate_command_emulated(args) -> int:
    """The handler of ``distgraph cluster calibrate --emulate FILE -n N -o OUT``."""

    prog = "distgraph cluster calibrate"
    try:
        source = Cluster.from_file(args.emulate)
        with tempfile.TemporaryDirectory(prefix="distgraph-calibrate-") as tmp:
            raw = os.path.join(tmp, "measured.yaml")
            rc = launch_emulated(args.emulate, args.nprocs,
                                 [CALIBRATE_SCRIPT, "-o", raw, "--repeats", str(args.repeats)],
                                 timeout=args.timeout)
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
    table, _ = comparison(source, out)
    print(f"wrote {args.output}: {source.name!r} measured on {args.nprocs} emulated ranks")
    print(table)
    return 0
