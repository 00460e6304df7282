"""The plan contract's types (distgraph/plan/protocols.py and the fields of every value
in distgraph/plan/): no field is typed ``object`` or ``Any``, and a planned plan holds
what its annotations say, all the way down.

Oracles: ``typing.get_type_hints`` of every dataclass of the contract; ``isinstance`` of
every field's value against its annotation, walking from real plans made with every
field filled (searched on a cluster with ``balance=True``, ``mtbf_hours`` and
micro-batches; a searched pipeline, whose report is the stage search's and whose
programs send and receive; a MeshSlice plan); the real classes of the layers above the
contract satisfy its Protocols.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import pkgutil
import sys
import types
import typing
from types import MappingProxyType

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import distgraph as dg  # noqa: E402
import distgraph.plan  # noqa: E402
from distgraph.plan import protocols  # noqa: E402
from distgraph.plan.plot import picture  # noqa: E402
from distgraph.program_builder import build_program  # noqa: E402

import plans as P  # noqa: E402
import search_cases as S  # noqa: E402

MODULES = [importlib.import_module(f"distgraph.plan.{m.name}")
           for m in pkgutil.iter_modules(distgraph.plan.__path__)]
CONTRACT = {c for m in MODULES for c in vars(m).values() if dataclasses.is_dataclass(c)
            and isinstance(c, type) and c.__module__ == m.__name__}


def _parts(hint) -> tuple:
    """The types a hint admits: the members of a union, the origin of a generic."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return tuple(p for arg in typing.get_args(hint) for p in _parts(arg))
    return (hint if origin is None else origin,)


def holds(value, hint) -> bool:
    return any(value is None if t is type(None) else isinstance(value, t)
               for t in _parts(hint))


def walk(root) -> dict:
    """{contract class: instances seen} from ``root``, through fields, tuples, lists and
    mappings; every field checked against its annotation on the way."""
    seen: dict = {}
    visited: set = set()
    stack = [root]
    while stack:
        value = stack.pop()
        if id(value) in visited:
            continue
        visited.add(id(value))
        if type(value) in CONTRACT:
            seen[type(value)] = seen.get(type(value), 0) + 1
            hints = typing.get_type_hints(type(value))
            for f in dataclasses.fields(value):
                held = getattr(value, f.name)
                assert holds(held, hints[f.name]), \
                    f"{type(value).__name__}.{f.name} holds a {type(held).__name__}, " \
                    f"annotated {hints[f.name]}"
                stack.append(held)
        elif isinstance(value, (tuple, list, frozenset, set)):
            stack.extend(value)
        elif isinstance(value, (dict, MappingProxyType)):
            stack.extend(value.values())
    return seen


def test_no_field_of_the_contract_is_object_or_any():
    assert len(CONTRACT) >= 30, sorted(c.__name__ for c in CONTRACT)
    loose = [f"{c.__name__}.{name}: {hint}" for c in CONTRACT
             for name, hint in typing.get_type_hints(c).items()
             if {object, typing.Any} & set(_parts(hint))]
    assert not loose, loose


@pytest.fixture(scope="module")
def balanced():
    """A searched plan on two devices of unequal speed with every optional field set."""
    strategy = dg.Strategy(auto_mode="full", balance=True, mtbf_hours=10.0, micro_batches=2)
    return dg.passes.plan(S.mlp_program(batch=128, hidden=32), strategy,
                          S.mixed_speed_cluster(2.0))


def test_a_plan_with_every_field_filled_holds_what_its_fields_say(balanced):
    plan = balanced
    assert all(f.name == "sample_axes" or getattr(plan, f.name) is not None
               for f in dataclasses.fields(plan))
    seen = walk(plan)
    for cls in ("Plan", "ProcessProgram", "LocalProgram", "Block", "OpInstr", "PointInstr",
                "GatherInstr", "ReshardPoint", "ReshardStep", "Task", "TaskGraph", "Schedule",
                "Action", "Accumulation", "TagScheme", "DeviceAssignment", "Feed"):
        assert cls in {c.__name__ for c in seen}, cls


def test_the_real_classes_satisfy_the_protocols(balanced):
    plan = balanced
    for value, protocol in ((plan.cluster, protocols.ClusterLike),
                            (plan.estimate, protocols.EstimateLike),
                            (plan.checkpoint, protocols.CheckpointIntervalLike),
                            (plan.search, protocols.SearchReportLike),
                            (plan.batch_split, protocols.BatchSplitLike)):
        assert isinstance(value, protocol), (type(value).__name__, protocol.__name__)
    assert all(isinstance(d, protocols.DeviceLike) for d in plan.cluster.devices)
    assert all(isinstance(p, protocols.ProcessEstimateLike) for p in plan.estimate.processes)
    # what the plan prints of them
    assert "checkpoint every" in plan.explain() and "batch split" in plan.explain(full=True)
    assert {"estimate", "checkpoint", "search", "batch_split"} <= set(plan.to_dict())


def test_a_searched_pipeline_sends_receives_and_reports_as_the_protocol_says():
    dims = dict(seq=4, d_in=16, hidden=16, d_out=16)
    dg.seed(0)
    data = P.Dataset("mlp", dims=dims, batch=16)
    ins, labels = dg.app.data.DataLoader(data, 16).specs(1)
    built = build_program(P.PlanMLP(dims, 2), ins, labels, P.loss_fn("mlp"),
                          dg.optim.AdamW(0.01))
    # two device meshes: a stage on each
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full", pipeline=True, micro_batches=2),
                          S.two_speed_cluster(ratio=1.0))
    assert type(plan.search).__name__ == "PipelineReport"
    assert isinstance(plan.search, protocols.SearchReportLike)
    seen = {c.__name__ for c in walk(plan)}
    assert {"SendInstr", "RecvInstr", "Transfer", "Flow"} <= seen


def test_a_meshslice_plan_and_its_picture_hold_what_their_fields_say():
    strategy = dg.Strategy(auto_mode="full", meshslice=True)
    plan = dg.passes.plan(S.mlp_program(128, 256), strategy, S.grid_cluster())
    assert plan.sliced
    seen = {c.__name__ for c in walk(plan) | walk(picture(plan))}
    assert {"SlicedMatmul", "Picture", "StageView", "LayerView", "WeightView"} <= seen
