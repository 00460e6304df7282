"""Start-up over 2 hosts x 2 ranks: ``distgraph run --hostfile`` until the first training
step, against ``mpiexec`` of a hello world on the same hosts.

Run as root (the hosts are network namespaces running sshd, made from the resource file:
:class:`~distgraph.runtime.emulate.ssh_hosts.SshHosts`)::

    python bench/multihost_startup.py [--cluster resources/clusters/emulated_2x2.yaml] [--repeats 5]

Per repeat, from the launching host, in turn:

- ``mpiexec hello``: the mpich wheel's mpiexec starting ``python -c`` hello world (MPI
  initialised, one barrier) on the hosts, until it exits;
- ``distgraph run hello``: the same hello world (as a script) through ``distgraph run
  --hostfile``, until it exits: what the launcher adds (the hosts' checks before, the
  logs and clean-up after);
- ``first step``: ``distgraph run --hostfile`` of a data-parallel MLP, from the start of
  the command until every rank has finished its first ``Engine.fit`` step (the ranks'
  clocks: the hosts share this box's).

It prints each time and the medians, and the ratios to ``mpiexec hello`` (target for the
first step: <= 1.5 x), and where the first step's time goes: until the ranks' Python
starts (``distgraph run`` itself: its imports, the hosts' checks, mpiexec and ssh),
until their script starts (the bootstrap, which imports distgraph), and the script
(tracing, planning and running the step); the latest rank each time (the clock of this
box, which the hosts share).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

STARTED = time.time()      # as early as a rank's script can tell
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELLO = ("from mpi4py import MPI; c = MPI.COMM_WORLD; c.Barrier(); "
         "print(f'hello from {c.Get_rank()} of {c.Get_size()}')")


def process_start(pid: int) -> float:
    """When process ``pid`` started (seconds since the epoch, to a clock tick).

    Its start is counted in clock ticks since boot; it goes back from now on the clock
    that counts since boot, not from /proc/stat's ``btime``, which is whole seconds and
    drifts from the wall clock (by a third of a second here)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    since_boot = time.clock_gettime(time.CLOCK_BOOTTIME)
    return time.time() - (since_boot - ticks / os.sysconf("SC_CLK_TCK"))


def rank_part(mode: str, started: float) -> None:
    """Inside the job: the hello world, or one training step; rank 0 prints the latest
    rank's times when its Python started (its supervisor, the rank's parent under
    distgraph run), its script started, and the step ended."""
    if mode == "hello":
        exec(HELLO)
        return
    import numpy as np
    from mpi4py import MPI

    import distgraph as dg

    world = MPI.COMM_WORLD
    mesh = dg.ProcessMesh(list(range(world.Get_size())), ["dp"])

    class MLP(dg.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = dg.nn.Linear(32, 64), dg.nn.Linear(64, 8)

        def forward(self, x):
            dg.shard_tensor(x, mesh, ["dp", None])
            return self.fc2(dg.ops.relu(self.fc1(x)))

    rng = np.random.default_rng(0)
    data = list(zip(rng.normal(size=(32, 32)).astype(np.float32),
                    rng.normal(size=(32, 8)).astype(np.float32)))
    engine = dg.Engine(MLP(), dg.nn.MSELoss(), dg.optim.SGD(0.01))
    engine.fit(data, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0)
    done = time.time()
    times = [world.allreduce(t, op=MPI.MAX)
             for t in (process_start(os.getppid()), started, done)]
    if world.Get_rank() == 0:
        print("FIRST-STEP " + " ".join(map(repr, times)), flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default=os.path.join(ROOT, "resources", "clusters",
                                                          "emulated_2x2.yaml"),
                        help="a resource file with 2 machines of 2 devices")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rank-part", choices=("hello", "step"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_part:
        rank_part(args.rank_part, STARTED)
        return 0

    import distgraph as dg
    from distgraph.runtime.emulate.ssh_hosts import SshHosts
    from distgraph.runtime.launch.launcher import mpiexec_path

    times: dict = {"mpiexec hello": [], "distgraph run hello": [], "first step": []}
    parts: dict = {"until Python starts": [], "until the script": [], "the script": []}
    with SshHosts(dg.Cluster.from_file(args.cluster), 4, log=open(os.devnull, "w")) as hosts:
        env = {**os.environ, **hosts.env(), "OMP_NUM_THREADS": "1"}
        hostfile = hosts.hostfile()
        hydra_hosts = ",".join(ln.strip() for ln in open(hostfile) if ln.strip())
        run = [sys.executable, "-m", "distgraph.cli", "run", "-n", "4", "--hostfile", hostfile,
               os.path.abspath(__file__), "--rank-part"]
        commands = {
            "mpiexec hello": [mpiexec_path(), "-n", "4", "-hosts", hydra_hosts,
                              sys.executable, "-c", HELLO],
            "distgraph run hello": [*run, "hello"],
            "first step": [*run, "step"],
        }
        for k in range(args.repeats):
            for name, command in commands.items():
                start = time.time()
                proc = subprocess.run(hosts.login_argv(command), env=env, cwd=ROOT,
                                      capture_output=True, text=True, timeout=600)
                end = time.time()
                if proc.returncode != 0:
                    print(f"{name} failed (exit code {proc.returncode}): "
                          f"{proc.stderr[-2000:]}", file=sys.stderr)
                    return 1
                if name == "first step":
                    line = next(ln for ln in proc.stdout.splitlines()
                                if ln.startswith("FIRST-STEP "))
                    python, script, end = map(float, line.split()[1:])
                    for part, seconds in zip(parts, (python - start, script - python,
                                                     end - script)):
                        parts[part].append(seconds)
                times[name].append(end - start)
                print(f"repeat {k + 1}: {name}: {end - start:.2f} s", flush=True)
    base = statistics.median(times["mpiexec hello"])
    print(f"medians over {args.repeats} repeats, 2 hosts x 2 ranks (seconds; ratio to "
          "mpiexec hello):")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:20}  {median:6.2f}  {median / base:5.2f} x")
    print(f"target: first step <= 1.5 x mpiexec hello "
          f"(here {statistics.median(times['first step']) / base:.2f} x); its parts:")
    for name, values in parts.items():
        print(f"  {name:20}  {statistics.median(values):6.2f}")
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        print("note: PYTHONDONTWRITEBYTECODE is set, so every process compiled the modules it "
              "imports from source (an installed package has them compiled); run with it unset "
              "to measure that")
    return 0


if __name__ == "__main__":
    sys.exit(main())
