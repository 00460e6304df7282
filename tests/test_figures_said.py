"""Where a plan's times come from, said: ``explain()`` calls a plan on default figures
"uncalibrated" and names the command that measures the machine; a plan on measured or
published figures says which; a float32 plan on devices with a much faster 16-bit rate
says so and names ``Strategy(amp=...)`` and ``dg.set_default_dtype``. Oracles: the
cluster's ``figures`` and its devices' rates."""

from __future__ import annotations

import dataclasses

import pytest

import distgraph as dg
from distgraph.program_builder import build_program
from distgraph.trace import InputSpec


def gpt_plan(cluster, strategy=None, dtype="float32"):
    before = dg.get_default_dtype()
    dg.set_default_dtype(dtype)
    try:
        model = dg.nn.GPT(vocab_size=64, d_model=32, n_layer=1, n_head=2, max_seq_len=8)
        mesh = dg.ProcessMesh([0, 1], ["dp"])
        strategy = strategy or dg.Strategy()
        built = build_program(model, [InputSpec([4, 8], "int64", "tokens")],
                              [InputSpec([4, 8], "int64", "labels")], dg.nn.CrossEntropyLoss(),
                              dg.optim.Adam(1e-3), amp=strategy.amp)
        dg.shard_tensor(built.program.values["tokens"], mesh, ["dp", None])
        return dg.passes.plan(built, strategy, cluster=cluster)
    finally:
        dg.set_default_dtype(before)


def test_a_plan_on_default_figures_is_uncalibrated_and_names_the_command():
    cluster = dg.Cluster.local(2)
    assert not cluster.calibrated and cluster.figures == ""
    text = gpt_plan(cluster).explain()
    assert "predicted (uncalibrated) = compute" in text
    assert "uncalibrated: cluster 'local2' gives default figures, not measurements" in text
    assert "measure the machine: distgraph cluster calibrate -n 2 -o local2.yaml (or " \
           "distgraph run without --cluster: it measures this machine once" in text


def test_a_plan_on_measured_or_published_figures_says_which():
    measured = dataclasses.replace(dg.Cluster.local(2), figures="measured",
                                   calibration={"ranks": 2})
    text = gpt_plan(measured).explain()
    assert "uncalibrated" not in text
    assert "figures: measured by distgraph cluster calibrate (cluster 'local2', 2 ranks)" in text
    # a file of an older calibration: no figures key, its calibration record says it
    older = dataclasses.replace(dg.Cluster.local(2), calibration={"ranks": 2})
    assert older.calibrated and "uncalibrated" not in gpt_plan(older).explain()
    dgx = dg.Cluster.from_file("resources/clusters/dgx_a100_1024.yaml")
    assert dgx.figures == "published" and dgx.calibrated
    text = gpt_plan(dgx).explain()
    assert "uncalibrated" not in text and "figures: published measurements" in text


def test_another_machine_is_measured_on_its_hosts():
    cluster = dg.Cluster.from_file("resources/clusters/gpu_2x8.yaml")
    assert not cluster.calibrated
    assert cluster.calibrate_command == ("distgraph cluster calibrate -n 16 --hosts "
                                         "node0:8,node1:8 -o gpu_2x8.yaml")
    text = gpt_plan(cluster).explain()
    assert cluster.calibrate_command in text and "distgraph run without" not in text


def test_float32_on_devices_with_a_faster_16_bit_rate_is_said_with_the_fix():
    cluster = dg.Cluster.from_file("resources/clusters/dgx_a100_1024.yaml")
    d = cluster.device(0)
    text = gpt_plan(cluster).explain()
    line = next(x for x in text.splitlines() if "precision:" in x)
    assert (f"computes in float32 at {d.flops('float32') / 1e12:.4g} TFLOP/s per device; its "
            f"devices run bfloat16 at {d.flops('bfloat16') / 1e12:.4g} TFLOP/s") in line
    assert "Strategy(amp='bfloat16')" in text and "dg.set_default_dtype('bfloat16')" in text
    # computing in bfloat16 already, or on devices without a faster rate: nothing to say
    assert "precision:" not in gpt_plan(cluster, dg.Strategy(amp="bfloat16")).explain()
    assert "precision:" not in gpt_plan(cluster, dtype="bfloat16").explain()
    assert "precision:" not in gpt_plan(dg.Cluster.local(2)).explain()


def test_a_file_that_says_where_its_figures_come_from_is_checked():
    data = dg.Cluster.local(2).to_dict()
    assert dg.Cluster.from_dict(dict(data, figures="measured")).figures == "measured"
    with pytest.raises(dg.ResourceFileError, match=r"figures: got 'guessed'; expected one of "
                       r"measured, published"):
        dg.Cluster.from_dict(dict(data, figures="guessed"))
    with pytest.raises(dg.ResourceFileError, match="figures"):
        dataclasses.replace(dg.Cluster.local(2), figures="guessed")
