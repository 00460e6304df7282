"""Sizes and id lists for people: the one byte formatter and the one id-range formatter.

Bytes are said in decimal units (kB, MB, GB: 10^3, 10^6, 10^9 bytes), the resource
file's unit for memory (a device's ``memory`` and ``reserved_memory``,
``Strategy(memory_budget_gb)``), so a peak, what a device may hold and its memory read in
one unit wherever they are printed.

Example::

    >>> fmt_bytes(16), fmt_bytes(4800), fmt_bytes(1.5e6), fmt_bytes(74e9), fmt_bytes(123.4e9)
    ('16 B', '4.8 kB', '1.5 MB', '74 GB', '123 GB')
    >>> fmt_ids(range(64)), fmt_ids([*range(64, 128), *range(192, 256)]), fmt_ids([3, 1])
    ('0-63', '64-127, 192-255', '1, 3')
    >>> fmt_ids(range(0, 1024, 8))
    '0, 8, ..., 1016'
"""

from __future__ import annotations

GB = 1e9            # resource files give memory in GB (decimal)


def fmt_bytes(n: float) -> str:
    """Three significant digits in decimal units (whole numbers from 100 up)."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_ids(ids, limit: int = 6) -> str:
    """The set ``ids`` (integers: processes, ranks, devices, stages) sorted, as runs:
    ``a-b`` for three or more consecutive ids, ``a, a+k, ..., b`` for four or more at a
    step k > 1, else each id; past ``limit`` runs, the first ``limit`` and how many ids
    there are in all (a line's length stays bounded whatever the count)."""
    rest = sorted(set(int(i) for i in ids))
    runs = []
    while rest:
        step = rest[1] - rest[0] if len(rest) > 1 else 1
        n = 1
        while n < len(rest) and rest[n] - rest[n - 1] == step:
            n += 1
        if step == 1 and n >= 3:
            runs.append(f"{rest[0]}-{rest[n - 1]}")
        elif step > 1 and n >= 4:
            runs.append(f"{rest[0]}, {rest[1]}, ..., {rest[n - 1]}")
        else:
            n = 1
            runs.append(str(rest[0]))
        rest = rest[n:]
    if len(runs) > limit:
        total = len(set(int(i) for i in ids))
        return ", ".join(runs[:limit]) + f", ... ({total} in all)"
    return ", ".join(runs)
