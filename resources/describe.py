"""Human-readable text for a Cluster: machines, device meshes and a link table.

Links with the same place (a machine, or between machines), type, bandwidth and latency
are one row, so a 128-machine cluster prints in a screenful.

Example::

    >>> from distgraph.resources.cluster import Cluster
    >>> print(Cluster.local(2).describe())            # doctest: +ELLIPSIS
    Cluster 'local2': 1 machine, 2 devices (2 CPU)
    ...
"""

from __future__ import annotations

import math
from collections import Counter

from distgraph.resources.elements import LinkGroup, _ranges

MAX_MACHINE_ROWS = 16
MAX_PAIRS_SHOWN = 3


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:g}"


def _table(header: list[str], rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(str(r[k])) for r in [header] + rows) for k in range(len(header))]
    out = []
    for r in [header] + rows:
        out.append(indent + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    return out


def describe(cluster) -> str:
    devices = cluster.devices
    counts = Counter(d.type for d in devices)
    kinds = ", ".join(f"{n} {t}" for t, n in counts.items())
    nm = len(cluster.machines)
    head = (f"Cluster {cluster.name!r}: {nm} machine{'s' if nm != 1 else ''}, "
            f"{len(devices)} devices ({kinds})")
    if cluster.nics:
        head += f", {len(cluster.nics)} NICs"
    if cluster.switches:
        head += f", {len(cluster.switches)} switch{'es' if len(cluster.switches) > 1 else ''}"
    lines = [head, "Machines:"]
    rows = []
    for m in cluster.machines[:MAX_MACHINE_ROWS]:
        groups = Counter((d.type, d.model) for d in m.devices)
        what = "; ".join(f"{n} x {t} {model}".rstrip() for (t, model), n in groups.items())
        rows.append([str(m.id), m.hostname + (f" ({m.addr})" if m.addr else ""), what,
                     _ranges(d.global_id for d in m.devices),
                     _ranges(n.global_id for n in m.nics) or "-"])
    lines += _table(["id", "host", "devices", "ids", "nics"], rows)
    if nm > MAX_MACHINE_ROWS:
        lines.append(f"  ... {nm - MAX_MACHINE_ROWS} more machines")
    if cluster.switches:
        lines.append("Switches: " + ", ".join(f"{s.global_id}" + (f" ({s.name})" if s.name else "")
                                              for s in cluster.switches))
    lines.append("Device meshes (per dim: worst pair's bandwidth GB/s / latency us):")
    rows = []
    for mesh in cluster.device_meshes:
        dims = ", ".join(f"{_fmt(b)}/{_fmt(la)}" for b, la in
                         zip(mesh.dim_bandwidths, mesh.dim_latencies))
        devs = [cluster.device(i) for i in mesh.ids]
        d0 = devs[0]
        rows.append([mesh.name, f"{mesh.device_type} {mesh.model}".strip(), str(mesh.shape),
                     _ranges(mesh.ids), dims, d0.memory_text,
                     " ".join(f"{k}={_span([d.gflops.get(k, 0.0) for d in devs])}"
                              for k in d0.gflops)])
    lines += _table(["name", "device", "shape", "ids", "dims", "memory", "GFLOP/s"], rows)
    lines.append("Links:")
    lines += _link_rows(cluster)
    if cluster.calibration:
        lines.append("Calibration: " + ", ".join(f"{k}={_fmt(v)}"
                                                 for k, v in cluster.calibration.items()))
    return "\n".join(lines)


def _link_rows(cluster) -> list[str]:
    # Rows group links inside machines by (type, bandwidth, latency) across machines, so
    # identical machines share one row; links between machines form their own rows.
    groups: dict[tuple, list] = {}
    implied = cluster.implied_links      # not in the file: said so in the type column
    for m in cluster.machines:
        for ln in m.links.elements:
            groups.setdefault(("inside", ln.type, ln.bandwidth, ln.latency), []).append((m.id, ln))
        for ln in implied.get(m.id, ()):
            groups.setdefault(("inside", f"{ln.type} (implied)", ln.bandwidth, ln.latency),
                              []).append((m.id, ln))
    for ln in cluster.links.elements:
        groups.setdefault(("between", ln.type, ln.bandwidth, ln.latency), []).append((None, ln))
    rows = []
    for (scope, ltype, bw, lat), members in groups.items():
        if scope == "inside":
            ids = sorted({mid for mid, _ in members})
            # "machines 0-1" would read as a link between machines 0 and 1
            where = (f"inside machine {ids[0]}" if len(ids) == 1
                     else f"inside each of machines {_ranges(ids)}")
        else:
            where = "between machines"
        pairs = ", ".join(f"each pair of {_ranges(ln.members)}" if isinstance(ln, LinkGroup)
                          else f"{ln.source}-{ln.target}" for _, ln in members[:MAX_PAIRS_SHOWN])
        if len(members) > MAX_PAIRS_SHOWN:
            pairs += ", ..."
        count = sum(ln.count if isinstance(ln, LinkGroup) else 1 for _, ln in members)
        rows.append([where, ltype or "-", _fmt(bw), _fmt(lat), str(count), pairs])
    if not rows:
        return ["  (none)"]
    return _table(["where", "type", "GB/s", "latency us", "count", "pairs"], rows)


def _span(values) -> str:
    """One figure, or ``low..high`` where a mesh's devices differ (same model, other speeds)."""
    low, high = min(values), max(values)
    return _fmt(low) if low == high else f"{_fmt(low)}..{_fmt(high)}"
