"""The partitioner's copies of a value sent to another mesh (passes/partition.py): sent
once, resharded there from the copy that arrived, and in the backward from the
smallest copy there, so that a stage whose first reader wants its input whole keeps it
split for the backward, as the stage search counts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import distgraph as dg
from distgraph.annotation import OpDistAttr
from distgraph.ir import Operation, Program, Role, Value
from distgraph.passes.partition import Partitions, partition
from distgraph.placement import DistAttr, ShardSpec

SCRIPTS = Path(__file__).parent / "mpi_scripts"
SHAPE = (4, 8)


def _stage_input_program() -> Program:
    """``x`` made split over ``y`` on mesh A = [0, 1]; on mesh B = [2, 3] the forward
    reads it whole (a LayerNorm), then split as made (a residual add), and the backward
    reads it split along the other dim, then whole again (the LayerNorm's gradient)."""
    a = dg.ProcessMesh([0, 1], ["y"])
    b = dg.ProcessMesh([2, 3], ["y"])
    whole, split, other = ShardSpec([None, None]), ShardSpec([None, "y"]), ShardSpec(["y", None])
    program = Program()

    def value(name, mesh, spec):
        return program.add_value(Value(name, SHAPE, "float32", dist_attr=DistAttr(mesh, spec)))

    def op(mesh, role, ins, specs, out, out_spec):
        result = value(out, mesh, out_spec)
        program.append_op(Operation("gelu" if len(ins) == 1 else "add", ins, [result],
                                    role=role, layer=out,
                                    dist_attr=OpDistAttr(mesh, specs, [out_spec])))

    feed = value("feed", a, split)
    program.inputs.append(feed)
    op(a, Role.FORWARD, [feed], [split], "x", split)
    x = program.values["x"]
    op(b, Role.FORWARD, [x], [whole], "normed", whole)
    op(b, Role.FORWARD, [x, program.values["normed"]], [split, whole], "residual", whole)
    op(b, Role.BACKWARD, [x], [other], "weight_grad", other)
    op(b, Role.BACKWARD, [x], [whole], "input_grad", whole)
    return program


def _reads_of_x(local) -> list:
    """(the index of the op the point is placed before, what it reads, what it writes) of each
    point that reshards ``x``, in order."""
    return [(q.anchor, q.reads, q.writes) for q in local.points() if q.value == "x"]


def test_the_backward_reshards_a_received_value_from_its_smallest_copy():
    program = _stage_input_program()
    local = partition(program, 2)
    assert _reads_of_x(local) == [
        (1, (), ("x@0",)),              # sent once, whole, for the first reader
        (2, ("x@0",), ("x@1",)),        # the residual's split copy, sliced from it
        (3, ("x@1",), ("x@2",)),        # the backward: from the split copy
        (4, ("x@1",), ("x@3",)),        # whole again, gathered from the split copy
    ]
    # the whole copy that arrived is read by the forward only: a stage holds x split
    # from its forward to its backward, not whole
    readers = [k for k, o in enumerate(local.program.ops)
               if any(v.name == "x@0" for v in o.inputs)]
    assert [local.program.ops[k].role for k in readers] == [Role.FORWARD]
    # every process partitions alike from the skeleton (Partitions) and alone
    assert [(q.seq, q.reads, q.writes) for q in Partitions(program)[2].points()] == \
        [(q.seq, q.reads, q.writes) for q in local.points()]
    # the sender sends x once
    assert sum(1 for q in partition(program, 0).points() if q.value == "x") == 1


@pytest.mark.mpi
def test_a_stage_that_reshards_its_received_input_in_the_backward_trains_as_serial():
    """On 4 real MPI ranks (float64, 1e-10): the second stage's LayerNorm reads its input
    whole, the residual add split; the backward gathers the input again from the split
    copy (rank 2 and 3 show the point), and training equals serial."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "distgraph.cli", "run", "-n", "4",
                           str(SCRIPTS / "received_copy.py")], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = {r["rank"]: r for r in (json.loads(line.split(" ", 1)[1])
                                      for line in proc.stdout.splitlines()
                                      if line.startswith("RECEIVED "))}
    assert sorted(reports) == [0, 1, 2, 3]
    for report in reports.values():
        assert report["loss"] <= 1e-10 and report["param"] <= 1e-10, report
    for rank in (2, 3):
        points = reports[rank]["points"]
        # arrived whole for the LayerNorm, sliced for the add, gathered again for the
        # LayerNorm's gradient from the split copy
        assert points == [["[None, None]", [], ["relu_0@0"], "forward"],
                          ["[None, mp]", ["relu_0@0"], ["relu_0@1"], "forward"],
                          ["[None, None]", ["relu_0@1"], ["relu_0@2"], "backward"]], points
