"""Where a plan's predicted times come from, in words: whether the cluster's figures
were measured (``Cluster.figures``, ``distgraph cluster calibrate``) and whether the plan
computes in a precision slower than its devices' fastest.

- :func:`calibration_note`: "uncalibrated" and the command that measures the machine,
  for a plan priced on a cluster whose figures are defaults; what measured them
  otherwise.
- :func:`precision_note`: a plan whose model FLOPs are mostly float32 on devices with a
  16-bit rate well above their float32 one says so, and names ``Strategy(amp=...)`` and
  ``dg.set_default_dtype``.

Both read the cluster by its attributes (``calibrated``, ``figures``, ``name``,
``calibrate_command``, ``devices``); the plan contract imports no resource module.

Example::

    >>> calibration_note(None)          # no cluster: nothing priced on figures
    []
"""

from __future__ import annotations

UNCALIBRATED = "uncalibrated"
FASTER = 1.5            # a 16-bit rate this many times float32's is worth a word
SIXTEEN_BIT = ("bfloat16", "float16")


def calibrated(cluster) -> bool:
    """Whether ``cluster``'s figures were measured or published (not defaults); a plan
    without a cluster is priced on :meth:`Cluster.local`'s defaults."""
    return cluster is not None and bool(getattr(cluster, "calibrated", False))


def calibration_note(cluster) -> list:
    """The lines on the figures a plan was priced with (module docstring); none without
    a cluster."""
    if cluster is None:
        return []
    name = f"cluster {cluster.name!r}" if cluster.name else "the cluster"
    if not calibrated(cluster):
        local = [m.hostname for m in cluster.machines] == ["localhost"]
        return [f"{UNCALIBRATED}: {name} gives default figures, not measurements: the "
                "times are guesses",
                f"measure the machine: {cluster.calibrate_command}" + (
                    " (or distgraph run without --cluster: it measures this machine once "
                    "and keeps it)" if local else "")]
    if cluster.figures == "published":
        return [f"figures: published measurements of the machine ({name}'s file names "
                "them)"]
    ranks = cluster.calibration.get("ranks") if cluster.calibration else None
    return [f"figures: measured by distgraph cluster calibrate ({name}"
            + (f", {int(ranks)} ranks)" if ranks else ")")]


def precision_note(dtype: str | None, devices) -> list:
    """Two lines where the model FLOPs are mostly float32 (``dtype``) on ``devices``
    whose fastest 16-bit rate is at least :data:`FASTER` times their float32 one, else
    none."""
    if dtype != "float32" or not devices:
        return []
    device = min(devices, key=lambda d: d.flops("float32") or float("inf"))
    single = device.flops("float32")
    half, fast = max(((device.flops(t), t) for t in SIXTEEN_BIT), key=lambda r: r[0])
    if not single or half < FASTER * single:
        return []
    return [f"precision: computes in float32 at {single / 1e12:.4g} TFLOP/s per device; its "
            f"devices run {fast} at {half / 1e12:.4g} TFLOP/s ({half / single:.3g}x)",
            f"  Strategy(amp={fast!r}) computes in {fast} with float32 master weights; "
            f"dg.set_default_dtype({fast!r}) builds the model in it"]
