"""This machine measured once for N ranks and kept: what ``distgraph run`` without
``--cluster`` (and ``distgraph cluster calibrate --local``) gives the job's Engine, and
what :meth:`Cluster.local(n) <distgraph.resources.cluster.Cluster.local>` then returns,
so that the times a plan predicts on the user's own machine are measured ones.

:func:`calibrated_local` runs ``distgraph cluster calibrate``'s script on N ranks here
the first time (a few tens of seconds), keeps the file under the cache folder
(:mod:`distgraph.resources.local_cache`: keyed by host, distgraph version and N) and
reuses it after; ``recalibrate`` measures again. ``$DISTGRAPH_CALIBRATE=never`` (what the
test suite sets) leaves ``distgraph run`` without a cluster file, as before.

Example::

    path = calibrated_local(4)          # measured now, or kept from before
    Cluster.local(4)                    # that cluster
"""

from __future__ import annotations

import dataclasses
import os
import sys

from distgraph.errors import DistGraphError
from distgraph.resources.cluster import Cluster
from distgraph.resources.local_cache import cached_local, local_file

CALIBRATE_VAR = "DISTGRAPH_CALIBRATE"      # "never": distgraph run measures nothing
TIMEOUT = 600.0


def wanted(env=None) -> bool:
    """Whether ``distgraph run`` without a cluster file measures this machine
    (``$DISTGRAPH_CALIBRATE`` is not ``never``)."""
    return (os.environ if env is None else env).get(CALIBRATE_VAR, "auto") != "never"


def calibrated_local(nprocs: int, recalibrate: bool = False, out=None) -> str:
    """The path of this machine's calibration for ``nprocs`` ranks: the kept one, or
    (none kept, or ``recalibrate``) one measured now on ``nprocs`` ranks and kept. Says
    so on ``out`` (default stderr) when it measures."""
    from distgraph.runtime.launch.launcher import TIMED_OUT, launch
    from distgraph.tools.calibrate import SCRIPT

    path = local_file(nprocs)
    if not recalibrate and cached_local(nprocs, _kept_device(path), Cluster.from_file):
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"distgraph: measuring this machine for {nprocs} rank(s), once: kept in {path} "
          "(distgraph run --recalibrate measures it again)", file=out or sys.stderr,
          flush=True)
    fresh = path.parent / f".{path.stem}.{os.getpid()}.yaml"
    code = launch(nprocs, [SCRIPT, "-o", str(fresh)], timeout=TIMEOUT)
    if code != 0 or not fresh.is_file():
        fresh.unlink(missing_ok=True)
        why = f"did not finish within {TIMEOUT:g} s" if code == TIMED_OUT else \
            f"failed (exit code {code})"
        raise DistGraphError(f"measuring this machine for {nprocs} rank(s) {why}; give a "
                             "resource file with --cluster, or set "
                             f"{CALIBRATE_VAR}=never to run on default figures")
    measured = _alike(Cluster.from_file(fresh), f"local{nprocs}")
    measured.save(fresh)
    os.replace(fresh, path)
    return str(path)


def _alike(measured: Cluster, name: str) -> Cluster:
    """``measured`` named as Cluster.local names this machine (``name``, host
    ``localhost``), each pair of its ranks joined by the median of the pairs' measured
    figures: they share one memory, and what tells one pair from another in a ping-pong
    is the other processes' turns, which a rank mapping should not follow."""
    import numpy as np

    out = []
    for m in measured.machines:
        links = m.links
        if links:
            bandwidth = float(np.median([ln.bandwidth for ln in links]))
            latency = float(np.median([ln.latency for ln in links]))
            links = tuple(dataclasses.replace(ln, bandwidth=round(bandwidth, 4),
                                              latency=round(latency, 3)) for ln in links)
        out.append(dataclasses.replace(m, hostname="localhost", links=links))
    return dataclasses.replace(measured, name=name, machines=tuple(out))


def _kept_device(path) -> str:
    """The device type of the kept file at ``path`` (CPU where there is none)."""
    if not path.is_file():
        return "CPU"
    try:
        devices = Cluster.from_file(path).devices
    except DistGraphError:
        return "CPU"
    return devices[0].type if devices else "CPU"
