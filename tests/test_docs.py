"""The pages under docs/ (the README's map): every python block of a page runs, in order,
as one script on the README's 4 ranks (``distgraph run -n 4``, in a folder of its own
that sees the repository's ``resources/`` and ``tutorials/``), after the README's first script up to its training (``model``, ``mesh``,
``engine``, ``Counting`` as the pages say). A block that needs what this machine has
not (a checkpoint folder, a GPU, a calibrated file, other hosts) is preceded by ``<!-- sketch: why; runs in PATH -->`` naming
the tutorial, bench or test that runs it: that block is compiled, not run, and PATH must
exist. The README keeps its first screen and the map, at most 400 lines."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "DESIGN.md")
SLOW = {"automatic.md", "search.md"}     # pages whose blocks search or autotune
BLOCK = re.compile(r"(?:<!-- sketch: (?P<why>[^>]*?); runs in (?P<path>\S+) -->\n+)?"
                   r"```python\n(?P<code>.*?)```", re.S)


def blocks(page: Path) -> list:
    """(code, None or (why, path)) of each python block of ``page``, in order."""
    return [(m["code"], (m["why"], m["path"]) if m["path"] else None)
            for m in BLOCK.finditer(page.read_text())]


def first_script() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## A first script"):]
    script = section[section.index("```python\n") + 10:section.index("```\n", 10)]
    return script[:script.index("history = engine.fit")]


def test_the_readme_is_its_first_screen_and_a_map():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 400
    for page in PAGES:
        assert f"(docs/{page.name})" in readme, page.name


def test_every_block_compiles_and_every_sketch_names_what_runs_it():
    assert PAGES
    for page in PAGES:
        for code, sketch in blocks(page):
            compile(code, str(page), "exec")
            if sketch is not None:
                assert sketch[0].strip(), (page.name, code[:80])
                assert (ROOT / sketch[1]).exists(), (page.name, sketch[1])


@pytest.mark.mpi
@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW
                                  else p for p in PAGES], ids=lambda p: p.name)
def test_the_pages_examples_run(page, tmp_path):
    runnable = [code for code, sketch in blocks(page) if sketch is None]
    if not runnable:
        pytest.skip(f"{page.name}: no python block to run (sketches name what runs them)")
    script = first_script() + "\n".join(f"# -- block {k}\n{code}"
                                        for k, code in enumerate(runnable))
    (tmp_path / "page.py").write_text(script)
    for folder in ("resources", "tutorials"):      # the paths the pages name, read only
        (tmp_path / folder).symlink_to(ROOT / folder)
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           str(tmp_path / "page.py")], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, (page.name, proc.stdout[-2000:] + proc.stderr[-3000:])
