"""Sizes for people: the one byte formatter.

Example::

    >>> fmt_bytes(16), fmt_bytes(4800), fmt_bytes(1.5 * 2 ** 20), fmt_bytes(3 * 2 ** 30)
    ('16 B', '4.69 KiB', '1.5 MiB', '3 GiB')
"""

from __future__ import annotations

GB = 1e9            # resource files give memory in GB (decimal)


def fmt_bytes(n: float) -> str:
    """Three significant digits in binary units (whole numbers from 100 up)."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"
