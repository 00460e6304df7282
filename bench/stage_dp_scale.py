"""Stage-DP benchmark: Alpa's inter-op DP on 48 layers and 32 devices.

Two clusters built in code, 4 machines x 8 GPUs each (NVLink 300 GB/s inside a machine,
12.5 GB/s between machines):

- homogeneous: 32 x A100-40GB (19.5 TFLOP/s float32), one device mesh of shape (4, 8);
- heterogeneous: 2 machines of A100-40GB and 2 of V100-32GB (15.7 TFLOP/s), two meshes
  of shape (2, 8), so the DP state counts the devices left on each mesh (17 x 17 states);
- small memory: 32 GPUs of V100 speed with 20 GB each, where one stage on all devices
  no longer fits and memory, with 1F1B's in-flight activations, shapes the split.

The layers are those of a 48-layer GPT with d_model 4096 (sequence 2048, micro-batch 8,
32 micro-batches), the first layer carrying the embedding and the last the LM head. The
cost callback stands in for the intra-op search: for a submesh of P devices it tries every
tensor-parallel degree tp (a power of two within one machine's row) with dp = P / tp and
keeps the fastest that fits memory: compute at 50% of peak, tp all-reduces of the
activations (4 per layer) over NVLink, the gradient all-reduce over dp once per step
(spread over the micro-batches; across machines when the submesh spans rows), and per
device the parameters with Adam state (16 bytes each) / tp plus the activations / P.

Prints the seconds :func:`plan_stages` took (callback included; target < 60 s on this
machine), how many time caps the DP solved, and the stages. Timings on a shared 2-core
machine are noisy: CPU seconds are printed beside the wall seconds.

Run: ``python bench/stage_dp_scale.py [--layers 48] [--micro-batches 32]``
"""

from __future__ import annotations

import argparse
import math
import time

from distgraph.passes.cost.formulas import collective_time
from distgraph.passes.search.stages.stage_dp import StageCost, plan_stages
from distgraph.resources.cluster import Cluster, Device, Link, Machine, Switch

A100 = ("A100-SXM4-40GB", 19500.0, 40.0)
V100 = ("V100-SXM2-32GB", 15700.0, 32.0)
SMALL = ("GPU-20GB", 15700.0, 20.0)             # a V100-class GPU with 20 GB
NVLINK, NET = (300.0, 2.0), (12.5, 7.0)          # GB/s, µs


def cluster_of(kinds, per_machine=8) -> Cluster:
    """One machine per entry of ``kinds``; GPUs linked by NVLink, machines by one switch."""
    ngpu = len(kinds) * per_machine
    switch = ngpu + len(kinds)
    hosts = []
    for m, (model, gflops, memory) in enumerate(kinds):
        ids = range(m * per_machine, (m + 1) * per_machine)
        nic = ngpu + m
        devices = [Device(g, g - m * per_machine, m, "GPU", model, {"float32": gflops}, memory)
                   for g in ids]
        links = [Link(a, b, NVLINK[0], NVLINK[1], "NVL") for a in ids for b in ids if a < b]
        links += [Link(g, nic, 32, 1, "PCIe") for g in ids]
        hosts.append(Machine(m, f"node{m}", devices, links,
                             (Device(nic, 0, m, "NIC", "ConnectX-6"),)))
    net = [Link(ngpu + m, switch, NET[0], 2.5, "NET") for m in range(len(kinds))]
    return Cluster(hosts, net, (Switch(switch, "core"),))


class GPTLayers:
    """Per-layer FLOPs, parameters and activations of a GPT, and the stage cost callback."""

    def __init__(self, layers, d=4096, seq=2048, batch=8, vocab=50304, micro_batches=32):
        self.L, self.d, self.seq, self.batch, self.B = layers, d, seq, batch, micro_batches
        block_flops = 3 * (24 * batch * seq * d * d + 4 * batch * seq * seq * d)
        self.flops = [block_flops] * layers
        self.params = [12 * d * d] * layers
        self.flops[-1] += 3 * 2 * batch * seq * d * vocab        # LM head
        self.params[0] += vocab * d                              # embedding
        self.params[-1] += vocab * d                             # LM head (untied)
        self.act = 34 * batch * seq * d * 2                      # bytes per layer, fp16

    def cost(self, layers: range, sub) -> StageCost:
        rows, cols = sub.shape
        size = sub.size
        flops = sum(self.flops[i] for i in layers)
        params = sum(self.params[i] for i in layers)
        peak = sub.device.flops("float32") * 0.5
        best = None
        for k in range(int(math.log2(cols)) + 1):
            tp = 1 << k
            if cols % tp:
                continue
            dp = size // tp
            t = flops / (size * peak)
            per_layer = self.batch * self.seq * self.d * 2 / dp
            t += 4 * len(layers) * collective_time("all_reduce", tp, per_layer, *NVLINK)
            link = NET if rows > 1 else NVLINK
            t += collective_time("all_reduce", dp, 4 * params / tp, *link) / self.B
            memory = (16 * params / tp) / 1e9
            act = self.act * len(layers) / size / 1e9
            if memory + act <= sub.device.usable_memory() and (best is None or t < best.time):
                best = StageCost(t, memory + act, act)
        # Nothing fits on this submesh: an infinite time keeps the DP away from it.
        return best or StageCost(math.inf, 0.0, 0.0)


def run(name, cluster, model):
    calls = [0]

    def cost(layers, sub):
        calls[0] += 1
        return model.cost(layers, sub)
    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_stages(model.L, cluster, cost, micro_batches=model.B)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    meshes = ", ".join(f"{m.name} {list(m.shape)} {m.model}" for m in cluster.device_meshes)
    print(f"\n{name}: {model.L} layers on {len(cluster.devices)} devices ({meshes})")
    print(f"  plan_stages: {wall:.2f} s wall, {cpu:.2f} s CPU; {calls[0]} cost calls, "
          f"{plan.dp_runs} time caps solved")
    print("  " + str(plan).replace("\n", "\n  "))
    return plan


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--micro-batches", type=int, default=32)
    args = ap.parse_args()
    model = GPTLayers(args.layers, micro_batches=args.micro_batches)
    run("homogeneous", cluster_of([A100] * 4), model)
    run("heterogeneous", cluster_of([A100, A100, V100, V100]), model)
    run("small memory", cluster_of([SMALL] * 4), model)


if __name__ == "__main__":
    main()
