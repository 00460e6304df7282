"""Values a micro-batched step makes once (distgraph.plan.accumulation.made_once): under amp
the 16-bit copies of the parameters are made before the first micro-batch and held once,
not once per micro-batch in flight; the step trains as the plain one does."""

import json

import numpy as np
import pytest

import distgraph as dg
from distgraph.ir import Role
from distgraph.plan.accumulation import made_once
from distgraph.program_builder import build_program
from user_scripts import run_user, with_prelude


def gpt_program(amp="bfloat16"):
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=2, n_head=2, max_seq_len=8)
    return build_program(model, [dg.InputSpec([8, 8], "int64", "tokens")],
                         [dg.InputSpec([8, 8], "int64", "labels")],
                         loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-3),
                         amp=amp)


def test_the_casts_of_the_parameters_are_made_once_and_nothing_that_reads_a_feed():
    """Oracle: the program read by hand. Every parameter is cast to bfloat16 once
    (``name@bfloat16``), and those casts read nothing but the parameter; the position
    embedding's lookup reads only positions made from nothing and wpe. Nothing a feed
    flows into is made once, nor anything an update reads, nor dropout."""
    program = gpt_program().program
    once = made_once(program)
    params = [v.name for v in program.values.values() if v.is_parameter]
    assert {f"{p}@bfloat16" for p in params} <= once
    from_feeds = {v.name for v in program.inputs}
    for op in program.ops:
        if any(v.name in from_feeds for v in op.inputs):
            from_feeds.update(o.name for o in op.outputs)
    assert not once & from_feeds
    for op in program.ops:
        if op.role is Role.OPTIMIZE or op.type == "dropout":
            assert not {v.name for v in op.inputs} & once - {o.name for o in op.outputs} \
                or op.type != "dropout"
            assert not {o.name for o in op.outputs} & once


def test_a_pipeline_runs_no_parameter_cast_per_micro_batch():
    """The compiled programs of a 2-stage amp pipeline of 4 micro-batches: each cast of
    a parameter is one of the step's once-made ops, in no task a micro-batch runs."""
    mesh = dg.ProcessMesh([0, 1], ["pp"])
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=2, n_head=2, max_seq_len=8)
    model = dg.parallelize(model, mesh, {"pp_config": {"split_spec": "blocks"}})
    built = build_program(model, [dg.InputSpec([8, 8], "int64", "tokens")],
                          [dg.InputSpec([8, 8], "int64", "labels")],
                          loss=dg.nn.CrossEntropyLoss(), optimizer=dg.optim.AdamW(1e-3),
                          amp="bfloat16")
    plan = dg.passes.plan(built, dg.Strategy(micro_batches=4, amp="bfloat16"))
    for pid in plan.process_ids:
        program = plan.program_of(pid)
        once = {out for instr in program.step_ops for out in instr.outs}
        casts = {o.name for op in program.local.program.ops if op.type == "cast"
                 and op.inputs[0].is_parameter for o in op.outputs}
        assert casts and casts <= once
        per_micro_batch = {out for block in program.blocks.values() for instr in block.instrs
                           for out in getattr(instr, "outs", ())}
        assert not casts & per_micro_batch


SCRIPT = """
    import json

    class Tokens:
        def __init__(self, n):
            self.x = np.random.default_rng(0).integers(0, 64, (n, 9))
        def __len__(self):
            return len(self.x)
        def __getitem__(self, i):
            return self.x[i, :-1].astype(np.int64), self.x[i, 1:].astype(np.int64)

    n = dg.runtime.launch.status.get_world_size()
    dg.seed(0)
    model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=4, n_head=2, max_seq_len=8)
    if n > 1:
        model = dg.parallelize(model, dg.ProcessMesh(list(range(n)), ["pp"]),
                               {"pp_config": {"split_spec": "blocks"}})
    engine = dg.Engine(model, dg.nn.CrossEntropyLoss(), dg.optim.AdamW(1e-2),
                       strategy=dg.Strategy(micro_batches=4, amp="bfloat16"))
    history = engine.fit(Tokens(32), batch_size=16, epochs=2, verbose=0)
    state = engine.state_dict()
    if engine.rank == 0:
        print("RESULT", json.dumps([history.losses,
                                    {k: float(np.abs(v).sum()) for k, v in state.items()}]))
"""


@pytest.mark.mpi
def test_an_amp_pipeline_on_two_ranks_trains_as_one_process_does(tmp_path):
    """Oracle: the same amp step on one process (every op on one device, the casts made
    once alike). The pipeline's stages run the same kernels on the same micro-batches:
    losses and float32 masters equal to float32's rounding of bfloat16 sums."""
    results = []
    for ranks in (1, 2):
        rc, out = run_user(tmp_path, with_prelude(SCRIPT), ranks, timeout=300)
        assert rc == 0, out
        line = next(x for x in out.splitlines() if x.startswith("RESULT"))
        results.append(json.loads(line.split(None, 1)[1]))
    (serial_losses, serial), (losses, state) = results
    np.testing.assert_allclose(losses, serial_losses, rtol=1e-6)
    assert serial_losses[-1] < serial_losses[0]
    assert state.keys() == serial.keys()
    for name in serial:
        np.testing.assert_allclose(state[name], serial[name], rtol=1e-6, err_msg=name)
