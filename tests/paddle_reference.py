"""Paddle's answers to the generated concat cases, recorded for tests/test_spmd_generated.py.

The generated cases (tests/spmd_cases.py, sampled as test_spmd_generated.py samples them:
forward, forward with about a third of the entries unknown, backward) are given to
Paddle's phi concat rule (``core.get_phi_spmd_rule("concat")``, ``infer_forward`` and
``infer_backward``); what it answers is written to ``tests/data/paddle_concat.json``,
which the tests compare distgraph's rule with. Paddle takes one mesh dim per tensor dim,
so the samples with a combined entry (``(x, y)``) are left out; an unknown entry is
given to Paddle as replicated (``-1``), its only way to say nothing.

Two steps, since Paddle and distgraph need not share an environment:

    python tests/paddle_reference.py samples > /tmp/samples.json      # with distgraph
    python tests/paddle_reference.py answer /tmp/samples.json \\
        > tests/data/paddle_concat.json                               # with paddlepaddle

(recorded with paddlepaddle 3.3.1, CPU).
"""

from __future__ import annotations

import json
import os
import random
import sys

MESHES = {"4": ([0, 1, 2, 3], ["x"]), "2x3": ([[0, 1, 2], [3, 4, 5]], ["x", "y"])}
OP = "concat"


def _entry(e):
    from distgraph.spmd import UNKNOWN
    return "?" if e is UNKNOWN else (list(e) if isinstance(e, tuple) else e)


def samples() -> list:
    """Every generated concat case: {mesh, direction, in_shapes, out_shapes, axis, given}."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from spmd_cases import CASES
    from spmd_cases import MESHES as DG_MESHES
    from test_spmd_generated import sample, with_unknowns

    out = []
    for case in (c for c in CASES if c.op == OP):
        for name, mesh in DG_MESHES.items():
            rng = random.Random(str(case) + "unknowns")
            given = sample(case.in_shapes, mesh, str(case))
            runs = [("forward", given),
                    ("partly known", [with_unknowns(specs, rng) for specs in given]),
                    ("backward", sample(case.out_shapes, mesh, str(case) + "backward"))]
            for direction, specs_list in runs:
                for specs in specs_list:
                    out.append({"mesh": name, "direction": direction,
                                "in_shapes": [list(s) for s in case.in_shapes],
                                "out_shapes": [list(s) for s in case.out_shapes],
                                "axis": case.attrs["axis"],
                                "given": [[_entry(e) for e in s.dims] for s in specs]})
    return out


def answer(records: list) -> list:
    """Paddle's answer to each record it can express (no combined entry)."""
    from paddle.distributed.auto_parallel.static.dist_attribute import (DistTensorSpec,
                                                                        TensorDistAttr)
    from paddle.distributed.fleet import auto
    from paddle.framework import core

    rule = core.get_phi_spmd_rule(OP)

    def spec(shape, entries, mesh, names):
        attr = TensorDistAttr()
        attr.process_mesh = mesh
        attr.dims_mapping = [-1 if e in (None, "?") else names.index(e) for e in entries]
        return DistTensorSpec(list(shape), attr)

    def named(attr, names):
        return [None if d < 0 else names[d] for d in attr.dims_mapping]

    out = []
    for r in records:
        if any(isinstance(e, list) for s in r["given"] for e in s):
            continue
        ids, names = MESHES[r["mesh"]]
        mesh = auto.ProcessMesh(mesh=ids, dim_names=names)
        if r["direction"] == "backward":
            unknown = [spec(s, [None] * len(s), mesh, names) for s in r["in_shapes"]]
            res = rule.infer_backward(unknown, spec(r["out_shapes"][0], r["given"][0], mesh,
                                                    names), r["axis"])
        else:
            res = rule.infer_forward([spec(s, g, mesh, names)
                                      for s, g in zip(r["in_shapes"], r["given"])], r["axis"])
        ins = res[0][0] if isinstance(res[0][0], list) else res[0]
        out.append({"mesh": r["mesh"], "direction": r["direction"], "given": r["given"],
                    "ins": [named(a, names) for a in ins],
                    "outs": [named(a, names) for a in res[1]]})
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["samples"]:
        json.dump(samples(), sys.stdout)
    elif sys.argv[1:2] == ["answer"] and len(sys.argv) == 3:
        with open(sys.argv[2]) as f:
            records = answer(json.load(f))
        sys.stdout.write("[\n" + ",\n".join(json.dumps(r) for r in records) + "\n]\n")
    else:
        sys.exit(__doc__)
