"""Kernels are written once, against ``xp``: every ``xp.<name>`` the ops, the runtime and
the tools use must exist in CuPy as in numpy. The names are read from the source with
``ast``, so a new use is checked the day it is written. CuPy's wheel imports without a
GPU; without CuPy the namespace test skips (``pip install 'distgraph[gpu]'`` runs it).

Kernels also call numpy (``np.``) only where the host is meant: the dropout mask is drawn
on the host from (seed, step), so a GPU draws the masks a CPU draws.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("distgraph", "runtime", "passes")
# (op class or table row, numpy name) pairs a kernel may call on the host, and why
# the mask from (seed, step), equal on CPU and GPU: drawn a block at a time into a host
# array, sliced there
HOST_CALLS = {("Dropout", "random"), ("Dropout", "empty"), ("Dropout", "greater_equal"),
              ("Dropout", "ascontiguousarray")}


def _chain(node) -> tuple | None:
    """("add", "at") for the expression ``<...>xp.add.at``, None when it is not on xp."""
    names = []
    while isinstance(node, ast.Attribute):
        if node.attr == "xp":
            return tuple(reversed(names)) or None
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "xp" and names:
        return tuple(reversed(names))
    return None


def xp_uses() -> dict:
    """{("add", "at"): ["distgraph/ops/nn_ops.py:249", ...]} over the package folders."""
    uses: dict = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute):
                    chain = _chain(node)
                    if chain:
                        uses.setdefault(chain, []).append(
                            f"{path.relative_to(ROOT)}:{node.lineno}")
    # keep the longest chain of each expression (xp.add.at, not also xp.add)
    return {c: w for c, w in uses.items()
            if not any(len(o) > len(c) and o[:len(c)] == c and set(w) <= set(uses[o])
                       for o in uses)}


def test_the_source_is_read():
    uses = xp_uses()
    for expected in (("matmul",), ("add", "at"), ("take_along_axis",), ("tri",)):
        assert expected in uses, expected


def test_every_xp_name_exists_in_cupy():
    cupy = pytest.importorskip(
        "cupy", reason="CuPy is not installed: pip install 'distgraph[gpu]' (the wheel "
                       "imports without a GPU) to check the kernels' names against it")
    missing = []
    for chain, where in sorted(xp_uses().items()):
        obj = cupy
        for name in chain:
            if not hasattr(obj, name):
                missing.append(f"xp.{'.'.join(chain)} ({', '.join(where[:3])})")
                break
            obj = getattr(obj, name)
    assert not missing, "CuPy lacks: " + "; ".join(missing)


def test_the_numpy_names_exist_too():
    """Numpy is the other namespace: the same names (CuPy-only ones excepted)."""
    cupy_only = {("asnumpy",), ("cuda", "get_current_stream")}
    missing = []
    for chain in xp_uses():
        obj = np
        for name in chain:
            if not hasattr(obj, name):
                if chain not in cupy_only:
                    missing.append(".".join(chain))
                break
            obj = getattr(obj, name)
    assert not missing


def _kernels(tree) -> list:
    """(op, kernel node) of a module: the ``kernel`` of each op class, and the kernel of
    each table row ``Row(name, kernel, ...)``: a lambda, or a function of the module."""
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    out = [(cls.name, fn) for cls in tree.body if isinstance(cls, ast.ClassDef)
           for fn in cls.body if isinstance(fn, ast.FunctionDef) and fn.name == "kernel"]
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Row":
            name, kernel = node.args[:2]
            if isinstance(kernel, ast.Name):
                kernel = functions[kernel.id]
            out.append((name.value, kernel))
    return out


def test_kernels_call_numpy_only_on_purpose():
    found, rows = set(), 0
    for path in sorted((ROOT / "distgraph" / "ops").glob("*.py")):
        for op, kernel in _kernels(ast.parse(path.read_text(), str(path))):
            rows += op.islower()
            for node in ast.walk(kernel):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id in ("np", "numpy"):
                    found.add((op, node.attr))
    assert rows >= 20, "the table rows' kernels were not found"
    assert found <= HOST_CALLS, f"kernels call numpy directly: {sorted(found - HOST_CALLS)}"


def _calls_on(path: Path, owner) -> list:
    """(name, positional argument count, line) of every call ``<...>.owner.name(...)``
    (``owner``: the attribute or variable the calls go through) in ``path``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            base = node.func.value
            name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)
            if name == owner:
                out.append((node.func.attr, len(node.args), node.lineno))
    return out


def test_the_nccl_calls_match_cupys_signatures():
    """runtime/comm/nccl.py never ran on a GPU here: its calls into cupy.cuda.nccl are
    checked against the library's own signatures (CuPy with NCCL loads without a GPU)."""
    pytest.importorskip("cupy", reason="CuPy is not installed: pip install 'distgraph[gpu]'")
    from cupy.cuda import nccl
    if not nccl.available:
        pytest.skip("CuPy finds no NCCL library: pip install nvidia-nccl-cu12")
    path = ROOT / "runtime" / "comm" / "nccl.py"
    module_calls = _calls_on(path, "nc")
    method_calls = _calls_on(path, "comm")
    assert {n for n, _, _ in method_calls} >= {"allGather", "allReduce", "reduceScatter",
                                               "send", "recv", "check_async_error", "abort"}
    wrong = []
    for name, nargs, line in module_calls:
        if not hasattr(nccl, name):
            wrong.append(f"line {line}: nccl.{name} does not exist")
    for name, nargs, line in method_calls:
        method = getattr(nccl.NcclCommunicator, name, None)
        if method is None:
            wrong.append(f"line {line}: NcclCommunicator.{name} does not exist")
            continue
        head = (method.__doc__ or "").splitlines()[0]
        params = [p for p in head[head.index("(") + 1:head.rindex(")")].split(",")
                  if p.strip() and p.strip() != "self"] if "(" in head else None
        if params is not None and len(params) != nargs:
            wrong.append(f"line {line}: NcclCommunicator.{name} takes {len(params)} "
                         f"arguments ({head}), the call gives {nargs}")
    constants = {node.attr for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Attribute) and node.attr.startswith("NCCL_")}
    constants |= {node.value for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value.startswith("NCCL_")}
    wrong += [f"nccl.{c} does not exist" for c in sorted(constants) if not hasattr(nccl, c)]
    assert not wrong, "; ".join(wrong)
