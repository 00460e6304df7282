"""Where this machine's calibration is kept: the resource file ``distgraph run`` (without
``--cluster``) and ``distgraph cluster calibrate --local`` measure once, and that
:meth:`Cluster.local(n) <distgraph.resources.cluster.Cluster.local>` then returns.

One file per host, distgraph version, calibration layout (:data:`LAYOUT`) and number of
ranks (the ranks share the cores, so 4 ranks are not 2 ranks twice):
``<cache>/clusters/<host>-<version>-c<layout>-n<ranks>.yaml``,
where ``<cache>`` is ``$DISTGRAPH_CACHE_DIR`` if set (tests set it to a temporary
folder: nothing of theirs reaches the user's home), else ``$XDG_CACHE_HOME/distgraph``,
else ``~/.cache/distgraph``. A new distgraph version measures again (what the runtime
costs may have changed), and so does a new layout of what calibration measures; so does
``distgraph run --recalibrate``.

Example::

    >>> import os
    >>> os.environ["DISTGRAPH_CACHE_DIR"] = "/tmp/dg-cache"
    >>> local_file(4).name.endswith("-n4.yaml")
    True
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from distgraph.version import __version__

CACHE_VAR = "DISTGRAPH_CACHE_DIR"
# what calibration measures, numbered: 2 times collectives over pairs of ranks too (the
# ``ring_round`` figure), which a file kept by layout 1 lacks
LAYOUT = 2


def cache_dir() -> Path:
    """The folder distgraph keeps what it measures of this machine in (module
    docstring)."""
    given = os.environ.get(CACHE_VAR)
    if given:
        return Path(given)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "distgraph"


def local_file(nprocs: int) -> Path:
    """The resource file this machine's calibration for ``nprocs`` ranks is kept in
    (whether or not it is there yet)."""
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()) or "host"
    version = re.sub(r"[^A-Za-z0-9._-]", "_", __version__)
    return cache_dir() / "clusters" / f"{host}-{version}-c{LAYOUT}-n{int(nprocs)}.yaml"


def cached_local(nprocs: int, device: str, load):
    """The kept calibration of ``nprocs`` ranks on ``device`` ("CPU" or "GPU") devices,
    loaded with ``load(path)``; None where there is none (or it measured other devices,
    or it no longer reads: a file of an older layout is measured again)."""
    path = local_file(nprocs)
    if not path.is_file():
        return None
    try:
        cluster = load(path)
    except Exception:   # noqa: BLE001 - a stale or broken cache is measured again
        return None
    devices = cluster.devices
    if len(devices) != nprocs or any(d.type != device for d in devices):
        return None
    return cluster
