"""Elastic jobs on an emulated cluster: ``distgraph run --emulate FILE --elastic``.

The namespaces of every machine of FILE that the first attempt uses stay up for the
whole job; each attempt (:mod:`distgraph.runtime.launch.elastic`) runs mpiexec on the
machines that answer, with a resource file of those machines only (written next to the
logs), so the Engine plans for what is left. While an attempt runs, the launcher probes
its machines' networks every :data:`PROBE_EVERY` seconds (:mod:`.probe`) and reads the
ranks' status files: a machine that stops answering, or a rank that died or failed,
stops the attempt at once (without waiting for a communication timeout); whatever is
left in the machines' namespaces is then killed. With ``--max-ranks``
(:meth:`ElasticPolicy.may_grow`), an attempt on fewer ranks also probes the machines it left out: once one answers again, the
attempt is stopped at the next checkpoint its rank 0 reports complete
(``<status>/0.checkpoint``), and the next attempt, on the machines that answer, resumes
from it.

Example::

    rc = launch_elastic("resources/clusters/emulated_2x2.yaml", 4, ["train.py"],
                        ElasticPolicy(min_ranks=2), faults=["machine node1 down at step 6"])
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

from distgraph.resources.cluster import Cluster
from distgraph.runtime.emulate.exec import GROUPS_VAR, HOSTS_VAR
from distgraph.runtime.emulate.faults import FaultInjector
from distgraph.runtime.emulate.launch import TRANSPORT_ENV, _write_wrapper, prepare
from distgraph.runtime.emulate.namespaces import Emulation, Terminated, folder_prefix
from distgraph.runtime.emulate.probe import answering
from distgraph.runtime.launch.elastic import ElasticPolicy, ElasticRun, Machine, Outcome
from distgraph.runtime.launch.launcher import launch
from distgraph.runtime.launch.progress import last_step
from distgraph.runtime.launch.status import failure_lines, read_states, read_status

PROBE_EVERY = 1.0       # seconds between two probes of a running attempt's machines
STATES_EVERY = 0.3      # seconds between two reads of its ranks' status files


def subcluster(cluster: Cluster, world) -> Cluster:
    """``cluster`` reduced to the machines of ``world`` (:class:`Machine`: hostname and
    how many of its devices, the first ones), device ids kept; the links between what is
    kept; device meshes inferred again."""
    data = cluster.to_dict()
    take = {m.name: m.slots for m in world}
    machines, kept = [], set()
    for m in data["machines"]:
        if m["hostname"] not in take:
            continue
        devices = sorted(m["devices"], key=lambda d: d["global_id"])[:take[m["hostname"]]]
        ids = {d["global_id"] for d in devices}
        kept |= ids
        links = [k for k in (_kept(ln, ids) for ln in m.get("links", [])) if k]
        machines.append({**m, "devices": devices, "links": links})
    reduced = {k: v for k, v in data.items() if k not in ("machines", "links", "device_meshes")}
    reduced["name"] = f"{data.get('name', 'cluster')}-{'-'.join(take)}"
    reduced["machines"] = machines
    reduced["links"] = [k for k in (_kept(ln, kept) for ln in data.get("links", [])) if k]
    return Cluster.from_dict(reduced, f"{cluster.name} reduced to {', '.join(take)}")


def _kept(link: dict, ids: set):
    """A resource file's link (a pair, or a group: every pair of its members) reduced to
    the ends in ``ids``; None where it joins fewer than two of them."""
    if "group" in link:
        members = [g for g in link["group"] if g in ids]
        return {**link, "group": members} if len(members) > 1 else None
    return link if {link["source"], link["target"]} <= ids else None


class EmulatedAttempts:
    """Runs the attempts of an elastic job on one :class:`Emulation` (module docstring)."""

    def __init__(self, cluster_file, layout, emulation, injector, argv, folder, log,
                 env=None, log_dir=None, timeout=None, policy=None):
        self.cluster = Cluster.from_file(cluster_file)
        self.policy = policy or ElasticPolicy()  # when to grow back
        self.layout, self.emulation, self.injector = layout, emulation, injector
        self.argv, self.folder, self.log = argv, folder, log
        self.env, self.log_dir, self.timeout = env, log_dir, timeout
        self.wrapper = _write_wrapper(folder)
        self.failed_at: float | None = None      # when the last failure was seen

    def machines(self) -> list[Machine]:
        return [Machine(m.hostname, len(m.ranks)) for m in self.layout.machines]

    def answering(self, names) -> set[str]:
        by_address = {self.layout.machine(n).address: n for n in names}
        return {by_address[a] for a in answering(self.layout.hub_namespace, by_address)}

    def _lost(self, world) -> list[str]:
        """The machines of ``world`` that do not answer."""
        alive = self.answering([m.name for m in world])
        return [m.name for m in world if m.name not in alive]

    def __call__(self, world, restart: int) -> Outcome:
        nprocs = sum(m.slots for m in world)
        cluster_file = os.path.join(self.folder, f"cluster-{restart}.json")
        subcluster(self.cluster, world).save(cluster_file)
        hosts = ",".join(f"{self.layout.machine(m.name).address}:{m.slots}" for m in world)
        seen: dict = {}

        def started(job):
            seen["status"] = job.status_dir
            self.injector.follow(job.status_dir, nprocs)

        log_dir = self.log_dir
        if log_dir is not None and restart:      # each attempt's logs kept apart
            log_dir = os.path.join(log_dir, f"restart-{restart}")
        rc = launch(nprocs, self.argv, cluster=cluster_file, env=self.env,
                    timeout=self.timeout, log_dir=log_dir,
                    mpiexec_args=["-launcher", "ssh", "-launcher-exec", self.wrapper,
                                  "-localhost", self.layout.hub_address, "-hosts", hosts],
                    prefix=("ip", "netns", "exec", self.layout.hub_namespace),
                    extra_env={**TRANSPORT_ENV, HOSTS_VAR: json.dumps(self.layout.host_map()),
                               GROUPS_VAR: json.dumps(self.emulation.procs_files())},
                    watch=self._watch(world, nprocs, restart, seen), restart=restart,
                    on_start=started)
        detected = seen.get("detected") or time.time()
        self.emulation.clear()           # a lost machine's proxy, ranks nobody could reach
        cause = seen.get("cause")
        if rc != 0 and cause is None:
            lost = self._lost(world)
            cause = f"machine {', '.join(lost)} stopped answering" if lost else None
        self.failed_at = detected if rc != 0 else None
        return Outcome(rc, cause if rc != 0 else None, detected)

    def _watch(self, world, nprocs: int, restart: int, seen: dict):
        """The attempt's watch: a reason to stop it, or None (see the module docstring);
        on a restart, says when its first step began."""
        clock = {"probe": time.monotonic(), "states": time.monotonic()}
        failed_at = self.failed_at

        def watch():
            status, now = seen.get("status"), time.monotonic()
            if status is None:
                return None
            step = last_step(status, 0) if restart and "first" not in seen else -1
            if step >= 0:
                seen["first"] = time.time()
                after = f" {seen['first'] - failed_at:.1f} s after the failure was seen" \
                    if failed_at else ""
                self.log.write(f"distgraph: elastic: restart {restart} on {nprocs} ranks "
                               f"began step {step}{after}\n")
            if now - clock["states"] >= STATES_EVERY:
                clock["states"] = now
                lines = failure_lines(read_states(status, nprocs), hosts=True)
                if lines:
                    return self._stop(seen, lines[0].split("\n")[0])
            if now - clock["probe"] >= PROBE_EVERY:
                clock["probe"] = now
                lost = self._lost(world)
                if lost:
                    return self._stop(seen, f"machine {', '.join(lost)} stopped answering")
                if "back" not in seen and self.policy.may_grow(
                        sum(m.slots for m in self.machines()), nprocs, restart):
                    self._rejoined(world, status, seen)
            if "back" in seen:
                saved = read_status(status, 0, "checkpoint")
                if saved is not None and int(saved) > seen["saved"]:
                    return self._stop(seen, f"machine {', '.join(seen['back'])} answers "
                                            f"again; growing from the checkpoint of step "
                                            f"{int(saved)}")
            return None

        return watch

    def _rejoined(self, world, status: str, seen: dict) -> None:
        """Note the machines left out of ``world`` that answer again, and the step of the
        last checkpoint reported so far: the attempt stops after the next one."""
        inside = {m.name for m in world}
        out = [m.hostname for m in self.layout.machines if m.hostname not in inside]
        back = sorted(self.answering(out)) if out else []
        if back:
            seen["back"] = back
            saved = read_status(status, 0, "checkpoint")
            seen["saved"] = -1 if saved is None else int(saved)

    @staticmethod
    def _stop(seen: dict, cause: str) -> str:
        seen.setdefault("detected", time.time())
        seen.setdefault("cause", cause)
        return seen["cause"]


def launch_elastic(cluster_file: str, nprocs: int, argv: list[str], policy: ElasticPolicy,
                   faults=(), env: dict | None = None, timeout: float | None = None,
                   log=None, log_dir: str | None = None) -> int:
    """Run ``argv`` as an elastic job on ``nprocs`` ranks of the emulated ``cluster_file``
    (module docstring); its exit code. The namespaces are gone when it returns."""
    log = sys.stderr if log is None else log
    layout, parsed = prepare(cluster_file, nprocs, faults)
    injector = None
    # without --log-dir, one temporary folder holds every attempt's logs: removed when
    # the job succeeds (its failed attempts included), kept and named when it fails
    temporary = log_dir is None
    log_dir = tempfile.mkdtemp(prefix="distgraph-logs-") if temporary else log_dir
    rc = 1
    try:
        with tempfile.TemporaryDirectory(prefix=folder_prefix("elastic", layout.job)) as tmp, \
                Emulation(layout, log) as emulation:
            log.write(layout.describe() + "\n")
            log.flush()
            injector = FaultInjector(emulation, parsed, log).start()
            attempts = EmulatedAttempts(cluster_file, layout, emulation, injector, argv, tmp,
                                        log, env, log_dir, timeout, policy)
            records = os.path.join(log_dir, "elastic.jsonl") if log_dir else None
            run = ElasticRun(attempts.machines(), nprocs, attempts, attempts.answering, policy,
                             log, records)
            rc = run.run()
            injector.stop()
            for wall, fault, state in injector.applied_wall():
                run.record(event="fault", time=wall, fault=str(fault), state=state)
            if injector.error is not None:
                log.write(f"distgraph: could not inject a fault: {injector.error}\n")
                rc = rc or 1
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Terminated) else 2
        log.write(f"distgraph: interrupted by signal {signum}; the emulated cluster was "
                  "removed\n")
        rc = 128 + signum
    finally:
        if injector is not None:
            injector.stop()
        if temporary and rc == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
        elif temporary:
            log.write(f"distgraph: elastic: every attempt's logs are in {log_dir}\n")
    return rc
