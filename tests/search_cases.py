"""The intra-op search's test cases: the issue's MLP (x @ w1 -> relu -> @ w2, MSE, SGD)
and clusters whose figures are written out, so that the cost model the search prices
with does not move when the defaults do.

Example::

    built = mlp_program(batch=1024, hidden=128)
    plan = dg.passes.plan(built, dg.Strategy(auto_mode="full"), line_cluster(4))
"""

from __future__ import annotations

import distgraph as dg
from distgraph.program_builder import build_program
from distgraph.trace import InputSpec

DEVICE = {"type": "CPU", "model": "cpu", "memory": 4, "gflops": {"float32": 50, "float64": 25},
          "memory_bandwidth": 10, "op_overhead": 20}


class TwoLayerMLP(dg.nn.Layer):
    """x @ w1 -> relu -> @ w2 (no biases), ``hidden`` wide, ``hidden`` in and out."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = dg.nn.Linear(hidden, hidden, bias=False)
        self.fc2 = dg.nn.Linear(hidden, hidden, bias=False)

    def forward(self, x):
        return self.fc2(dg.ops.relu(self.fc1(x)))


def mlp_program(batch: int, hidden: int, annotate=None):
    """The training program (MSE, SGD) of a fresh TwoLayerMLP; ``annotate(model)`` may
    mark it first."""
    dg.seed(0)
    model = TwoLayerMLP(hidden)
    if annotate is not None:
        annotate(model)
    return build_program(model, [InputSpec([batch, hidden], name="x")],
                         [InputSpec([batch, hidden], name="y")], dg.nn.MSELoss(),
                         dg.optim.SGD(0.1))


# A device whose time is its FLOPs alone (no launch cost, memory never the bottleneck):
# layers of equal FLOPs then cost the same.
FLOPS_ONLY = dict(DEVICE, memory_bandwidth=1e6, op_overhead=0)


def _device(gid: int, local: int, device=None) -> dict:
    return dict(device or DEVICE, global_id=gid, local_id=local)


def line_cluster(n: int, bandwidth: float = 10.0, latency: float = 1.0,
                 device=None) -> dg.Cluster:
    """One machine of ``n`` devices, every pair linked alike: a 1-D device mesh."""
    return dg.Cluster.from_dict(line_cluster_data(n, bandwidth, latency, device))


def line_cluster_data(n: int, bandwidth: float = 10.0, latency: float = 1.0,
                      device=None) -> dict:
    """:func:`line_cluster`'s resource file data (to write as a .json resource file)."""
    links = [{"group": list(range(n)), "bandwidth": bandwidth, "latency": latency}]
    return {"name": f"line{n}", "machines": [
        {"id": 0, "hostname": "m0", "devices": [_device(i, i, device) for i in range(n)],
         "links": links}]}


def two_speed_cluster(ratio: float = 2.0) -> dg.Cluster:
    """Two machines of one device each, the first ``ratio`` times the second's GFLOP/s
    (two device models, so two device meshes)."""
    fast = dict(FLOPS_ONLY, model="fast", gflops={"float32": 50 * ratio, "float64": 25 * ratio})
    slow = dict(FLOPS_ONLY, model="slow")
    machines = [{"id": m, "hostname": f"node{m}", "devices": [_device(m, 0, kind)]}
                for m, kind in enumerate((fast, slow))]
    return dg.Cluster.from_dict({"name": "two_speeds", "machines": machines, "links": [
        {"source": 0, "target": 1, "bandwidth": 10.0, "latency": 1.0}]})


def mixed_speed_cluster(ratio: float = 2.0, slow_first: bool = False) -> dg.Cluster:
    """Two machines of one device each, one device model (so one 1-D device mesh), the
    fast device ``ratio`` times the slow one's GFLOP/s; device 0 is the slow one with
    ``slow_first``."""
    fast = dict(FLOPS_ONLY, gflops={"float32": 50 * ratio, "float64": 25 * ratio})
    kinds = (FLOPS_ONLY, fast) if slow_first else (fast, FLOPS_ONLY)
    machines = [{"id": m, "hostname": f"node{m}", "devices": [_device(m, 0, kind)]}
                for m, kind in enumerate(kinds)]
    return dg.Cluster.from_dict({"name": "mixed_speeds", "machines": machines, "links": [
        {"source": 0, "target": 1, "bandwidth": 10.0, "latency": 1.0}]})


def grid_cluster(fast: float = 100.0, slow: float = 1.0, latency: float = 1.0) -> dg.Cluster:
    """2 machines x 2 devices: a (2, 2) device mesh whose dim 1 (inside a machine) has
    ``fast`` GB/s and dim 0 (across the machines) ``slow``."""
    machines = [{"id": m, "hostname": f"node{m}",
                 "devices": [_device(2 * m, 0), _device(2 * m + 1, 1)],
                 "links": [{"source": 2 * m, "target": 2 * m + 1, "bandwidth": fast,
                            "latency": latency}]} for m in range(2)]
    links = [{"source": a, "target": b, "bandwidth": slow, "latency": latency}
             for a in (0, 1) for b in (2, 3)]
    return dg.Cluster.from_dict({"name": "grid2x2", "machines": machines, "links": links})


def forward_matmuls(plan) -> list:
    """The completed forward matmuls of a plan, in program order."""
    return [op for op in plan.program.ops if op.type == "matmul" and op.role == "forward"]
