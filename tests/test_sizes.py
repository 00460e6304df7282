"""Small modules (CONVENTIONS.md 7): no module of the four package folders is over
MAX_LINES lines, so each stays readable in one sitting (tinygrad's size check, as a test).
A module that grows past it is split by what it does, not trimmed of its comments."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("distgraph", "resources", "passes", "runtime")
MAX_LINES = 600


def test_no_module_is_over_the_size_limit():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")}
    assert len(sizes) > 100                 # the folders were found and read
    over = sorted(f"{name}: {n} lines" for name, n in sizes.items() if n > MAX_LINES)
    assert not over, f"modules over {MAX_LINES} lines (split them):\n" + "\n".join(over)
