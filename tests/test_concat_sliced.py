"""A concat whose result is taken split on the concat dim computes only its slice
(``EinsumRule(sliced=True)``, as Paddle's phi concat keeps such an output): the plan
says so, each process's local concat has the window of its slice, and training equals
serial training (fp64, 1e-12)."""

import numpy as np

import distgraph as dg
from distgraph import ops
from distgraph.passes.partition import partition
from distgraph.program_builder import build_program
from distgraph.runtime.comm.simulated import SimulatedWorld
from distgraph.runtime.execution.executor import ProgramRunner
from distgraph.runtime.execution.runner import PlanRunner


class Joined(dg.nn.Layer):
    """Two projections concatenated, the result annotated split over ``mp`` on the
    concat dim (the rows a row-parallel layer after it reads)."""

    def __init__(self, mesh=None):
        super().__init__()
        self.a, self.b, self.out = dg.nn.Linear(6, 4), dg.nn.Linear(6, 8), dg.nn.Linear(12, 3)
        self.mesh = mesh

    def forward(self, x):
        y = ops.concat([self.a(x), self.b(x)], axis=-1)
        if self.mesh is not None:
            y = dg.shard_tensor(y, self.mesh, [None, "mp"])
        return self.out(y)


def build(mesh=None):
    dg.seed(1)
    model = Joined(mesh)
    if mesh is not None:
        dg.shard_tensor(model.out.weight, mesh, ["mp", None])
    opt = dg.optim.SGD(0.1)
    built = build_program(model, [dg.InputSpec([8, 6], "float64", "x")],
                          [dg.InputSpec([8, 3], "float64", "y")], dg.nn.MSELoss(), opt)
    init = {n: p.numpy() for n, p in model.named_parameters()}
    init.update(opt.initial_state(built.program))
    return built, init


def test_a_concat_taken_split_on_its_axis_computes_its_slice_and_trains_like_serial():
    previous = dg.get_default_dtype()
    dg.set_default_dtype("float64")
    try:
        rng = np.random.default_rng(0)
        data = [(rng.normal(size=(8, 6)), rng.normal(size=(8, 3))) for _ in range(3)]
        built, scope = build()
        runner = ProgramRunner(built.program)
        ref = [float(runner.run(scope, {"x": x, "y": y}, [built.loss_name], s)
                     [built.loss_name]) for s, (x, y) in enumerate(data)]
        built, init = build(dg.ProcessMesh([0, 1], ["mp"]))
        plan = dg.passes.plan(built)
        concat = next(op for op in plan.program.ops if op.type == "concat")
        assert [str(s) for s in concat.dist_attr.input_specs] == ["[None, None]"] * 2
        assert [str(s) for s in concat.dist_attr.output_specs] == ["[None, mp]"]
        for pid, window in ((0, (0, 6)), (1, (6, 12))):
            local = next(op for op in partition(plan.program, pid).program.ops
                         if op.type == "concat")
            assert local.attrs["window"] == window
        names = [v.name for v in plan.program.persistables]

        def rank(comm):
            runner = PlanRunner(plan, comm)
            local = runner.shard_scope(init)
            losses = [float(runner.run(local, {"x": x, "y": y}, s)[built.loss_name])
                      for s, (x, y) in enumerate(data)]
            return losses, runner.gather(local, names)

        for losses, params in SimulatedWorld(2).run(rank):
            assert np.allclose(losses, ref, rtol=1e-12, atol=0)
            for name, value in scope.items():
                if "@" not in name:
                    assert np.max(np.abs(params[name] - value)) < 1e-12, name
    finally:
        dg.set_default_dtype(previous)
