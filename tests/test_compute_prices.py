"""Compute priced by shape (passes/cost/compute.py, ``op_time``): a GEMM's time from its
m, n, k and the device's GEMM curve, against closed forms of tile and wave quantisation,
split-K and the roofline; views priced at their launch; the resource file's ``gemm``
entry read, written and refused with the key named."""

from __future__ import annotations

import dataclasses
import math

import pytest

import distgraph as dg
from distgraph.passes.cost.compute import gemm_seconds, gemm_shape
from distgraph.passes.cost.prices import device_rates, op_time
from distgraph.registry import TensorType as T
from distgraph.resources.elements import Device, GemmCurve

RATE = 100e12            # FLOP/s of full waves of full tiles
BW = 2e12                # bytes/s


def waves_time(b, m, n, k, units, tile, fill, rate=RATE):
    """The closed form of one tile size without split-K: ceil(tiles / units) waves of
    2 r c (k + fill) / (rate / units) each."""
    r, c = tile
    tiles = b * math.ceil(m / r) * math.ceil(n / c)
    return math.ceil(tiles / units) * 2 * r * c * (k + fill) / (rate / units)


def test_a_gemm_of_whole_waves_runs_at_the_rate_of_its_tiles():
    curve = GemmCurve(4, (128, 128), 0, 0)
    # 4 x 2 tiles of 128 x 128 on 4 units: 2 waves, every unit busy, nothing wasted
    t = gemm_seconds(1, 512, 256, 4096, 2, RATE, curve, BW)
    assert t == pytest.approx(2 * 512 * 256 * 4096 / RATE)


def test_one_tile_more_than_the_units_takes_a_second_wave():
    # tiles below 128 x 128 reuse an element fewer than 64 times: they run slower
    curve = GemmCurve(4, (128, 128), 0, 64)
    full = gemm_seconds(1, 512, 128, 4096, 2, RATE, curve, BW)        # 4 tiles: 1 wave
    one_more = gemm_seconds(1, 640, 128, 4096, 2, RATE, curve, BW)    # 5 tiles: 2 waves
    assert full == pytest.approx(waves_time(1, 512, 128, 4096, 4, (128, 128), 0))
    assert one_more == pytest.approx(2 * full)
    # at the full rate whatever their size, 32-row tiles fill the 4 units exactly (20
    # tiles, 5 waves): the GEMM runs at the rate
    free = dataclasses.replace(curve, reuse=0)
    assert gemm_seconds(1, 640, 128, 4096, 2, RATE, free, BW) == \
        pytest.approx(2 * 640 * 128 * 4096 / RATE)


def test_a_tile_that_reuses_little_runs_below_the_rate():
    curve = GemmCurve(1, (64, 64), 0, 32)
    # one unit: no wave to lose; the 8 rows cut every tile to 8 x 64 (reuse 8*64/72)
    t = gemm_seconds(1, 8, 640, 1024, 4, RATE, curve, 1e18)
    reuse = 8 * 64 / (8 + 64)
    assert t == pytest.approx(2 * 8 * 640 * 1024 / (RATE * reuse / 32))


def test_the_fill_of_each_tile_costs_steps_of_k():
    curve = GemmCurve(1, (64, 64), 16, 0)
    t = gemm_seconds(1, 64, 64, 48, 4, RATE, curve, 1e18)
    assert t == pytest.approx(2 * 64 * 64 * (48 + 16) / RATE)


def test_few_tiles_split_k_to_fill_the_units():
    curve = GemmCurve(16, (128, 128), 0, 64)
    # one tile (smaller ones run slower), k = 4096: 16 splits of 256 steps fill the units;
    # their 32-bit partials are added at the memory bandwidth
    t = gemm_seconds(1, 128, 128, 4096, 2, RATE, curve, BW)
    split = 2 * 128 * 128 * 256 / (RATE / 16) + 16 * 128 * 128 * 4 / BW
    assert t == pytest.approx(split)
    assert t < 2 * 128 * 128 * 4096 / (RATE / 16) / 8


def test_below_the_ridge_a_gemm_moves_its_operands_at_the_memory_bandwidth():
    curve = GemmCurve(4, (128, 128), 0, 0)
    m, n, k = 4096, 4096, 1                   # an outer product: 2 FLOPs per 2-byte result
    t = gemm_seconds(1, m, n, k, 2, RATE, curve, BW)
    assert t == pytest.approx((m * k + k * n + m * n) * 2 / BW)


def test_without_a_curve_a_gemm_is_the_roofline():
    assert gemm_seconds(2, 64, 64, 64, 4, RATE, None, BW) == \
        pytest.approx(max(2 * 2 * 64 ** 3 / RATE, 2 * 3 * 64 * 64 * 4 / BW))


@pytest.mark.parametrize("ins, attrs, shape", [
    ([(4, 8, 16), (16, 32)], {}, (1, 32, 32, 16)),                       # a Linear: one GEMM
    ([(2, 3, 8, 16), (2, 3, 8, 16)], {"transpose_y": True}, (6, 8, 8, 16)),    # q k^T
    ([(2, 3, 16, 8), (2, 3, 16, 4)], {"transpose_x": True}, (6, 8, 4, 16)),
    ([(4, 8, 16), (4, 8, 32)], {"rows": True}, (1, 16, 32, 32)),          # a weight's grad
])
def test_a_matmul_is_the_gemms_its_kernel_runs(ins, attrs, shape):
    from distgraph.registry import get_op

    ins = [T(s, "float32") for s in ins]
    out = get_op("matmul").infer(*ins, **attrs)
    assert gemm_shape("matmul", ins, [out], attrs) == shape
    b, m, n, k = shape
    assert get_op("matmul").flops(ins, [out], **attrs) == 2 * b * m * n * k
    assert gemm_shape("add", ins[:1] * 2, ins[:1], {}) is None


def test_op_time_prices_a_gemm_by_the_curve_and_a_view_at_its_launch():
    """A launch and its op's work: added up on a CPU (with the casts of its 16-bit
    operands), the longer of the two on a GPU."""
    curve = GemmCurve(8, (128, 128), 32, 16)
    device = Device(0, 0, 0, "GPU", "x", {"bfloat16": 100000.0}, 80, memory_bandwidth=2000,
                    op_overhead=3, gemm=curve)
    ins, out = [T((2048, 1024), "bfloat16"), T((1024, 512), "bfloat16")], T((2048, 512),
                                                                              "bfloat16")
    work = gemm_seconds(1, 2048, 512, 1024, 2, 100e12, curve, 2000e9)
    assert work > 3e-6
    # a GPU queues its launches: an op costs the longer of its launch and its work
    assert op_time("matmul", ins, [out], {}, device) == pytest.approx(work)
    small = [T((16, 1024), "bfloat16"), T((1024, 16), "bfloat16")], [T((16, 16), "bfloat16")]
    assert op_time("matmul", *small, {}, device) == pytest.approx(3e-6)
    # a CPU runs one after the other, and computes 16-bit operands in float32: it widens
    # them and rounds the result (here at their 2 + 4 bytes an element at the memory
    # bandwidth: the device has no measured cost of a cast)
    cpu = dataclasses.replace(device, type="CPU")

    def casts(ins, out):
        return 6 * (sum(math.prod(t.shape) for t in ins) + math.prod(out.shape)) / 2000e9

    assert op_time("matmul", ins, [out], {}, cpu) == pytest.approx(3e-6 + work + casts(ins,
                                                                                       out))
    assert op_time("matmul", *small, {}, cpu) == pytest.approx(
        3e-6 + gemm_seconds(1, 16, 16, 1024, 2, 100e12, curve, 2000e9)
        + casts(small[0], small[1][0]))
    x = T((4096, 4096), "float32")
    roof = 3 * 4096 * 4096 * 4 / 2000e9          # its bytes at the memory bandwidth
    assert op_time("add", [x, x], [x], {}, device) == pytest.approx(max(3e-6, roof))
    assert op_time("add", [x, x], [x], {}, cpu) == pytest.approx(3e-6 + roof)
    flat = dataclasses.replace(device, gemm=None)      # the roofline: no quantisation
    assert op_time("matmul", ins, [out], {}, flat) < op_time("matmul", ins, [out], {}, device)
    x = T((64, 1024, 1024), "bfloat16")
    assert op_time("reshape", [x], [T((64, 2 ** 20), "bfloat16")], {"shape": [64, -1]},
                   device) == device_rates(device)[1]


def test_the_gemm_entry_round_trips_and_a_bad_one_names_its_key(tmp_path):
    data = dg.Cluster.local(2).to_dict()
    data["machines"][0]["devices"][0]["gemm"] = {"units": 108, "tile": [256, 128],
                                                  "k_fill": 171, "reuse": 60}
    cluster = dg.Cluster.from_dict(data)
    assert cluster.device(0).gemm == GemmCurve(108, (256, 128), 171, 60)
    assert cluster.device(1).gemm is None
    path = tmp_path / "c.yaml"
    cluster.save(path)
    assert dg.Cluster.from_file(path).device(0).gemm == GemmCurve(108, (256, 128), 171, 60)
    data["machines"][0]["devices"][0]["gemm"] = {"units": 0, "tile": [256, 128]}
    with pytest.raises(dg.ResourceFileError, match=r"machines\[0\]\.devices\[0\]\.gemm\.units"):
        dg.Cluster.from_dict(data)
    data["machines"][0]["devices"][0]["gemm"] = {"units": 8, "tile": [256]}
    with pytest.raises(dg.ResourceFileError, match=r"gemm\.tile: got 1 numbers"):
        dg.Cluster.from_dict(data)


def test_the_published_machines_price_large_gemms_near_their_rate_and_say_whence():
    h100 = dg.Cluster.from_file("resources/clusters/h100_16384.yaml").device(0)
    big = gemm_seconds(1, 8192, 8192, 8192, 2, h100.flops("bfloat16"), h100.gemm,
                       h100.memory_bandwidth * 1e9)
    rate = 2 * 8192 ** 3 / big
    # full waves of large tiles, less the fill of each tile's k
    assert 0.85 * 869e12 < rate < 869e12
    # 4 tiles of 128 x 128 on 132 SMs: well below the rate, even split over k
    small = gemm_seconds(1, 256, 256, 4096, 2, h100.flops("bfloat16"), h100.gemm,
                         h100.memory_bandwidth * 1e9)
    assert 2 * 256 * 256 * 4096 / small < 0.3 * rate


def test_a_float32_product_of_16_bit_operands_is_priced_at_their_rate():
    """matmul(out_dtype="float32") (a weight's gradient under amp) computes at its
    operands' bfloat16 rate and writes float32: by the roofline and by the curve."""
    device = Device(0, 0, 0, "GPU", "x", {"bfloat16": 100000.0, "float32": 10000.0}, 80,
                    memory_bandwidth=2000, op_overhead=3)
    ins = [T((4096, 4096), "bfloat16"), T((4096, 4096), "bfloat16")]
    wide, narrow = T((4096, 4096), "float32"), T((4096, 4096), "bfloat16")
    attrs = {"out_dtype": "float32"}
    flops = 2 * 4096 ** 3
    assert op_time("matmul", ins, [wide], attrs, device) == pytest.approx(flops / 100e12)
    assert op_time("matmul", ins, [wide], attrs, device) == \
        op_time("matmul", ins, [narrow], {}, device)
    curve = dataclasses.replace(device, gemm=GemmCurve(8, (128, 128), 32, 16))
    assert op_time("matmul", ins, [wide], attrs, curve) == pytest.approx(
        gemm_seconds(1, 4096, 4096, 4096, 4, 100e12, curve.gemm, 2000e9))
