"""Reaching a job's hosts the way hydra does, for what ``distgraph run`` does there itself:
the checks before any rank starts, and after the job, stopping what is left and bringing
each host's status files and logs back (:mod:`distgraph.runtime.launch.hostside` runs
on the hosts).

hydra's launcher, and so ours: ``$HYDRA_LAUNCHER`` (or ``$HYDRA_BOOTSTRAP``), else
``slurm`` inside a Slurm allocation, else ``ssh``; its program ``$HYDRA_LAUNCHER_EXEC``
(or ``$HYDRA_BOOTSTRAP_EXEC``), else ``ssh`` / ``rsh`` / ``srun``, with
``$HYDRA_LAUNCHER_EXTRA_ARGS`` after it, as hydra adds them. So a site's ssh options (a
wrapper around ``ssh -F config`` in ``HYDRA_LAUNCHER_EXEC``, an ``~/.ssh/config``) apply
to both. ssh runs in batch mode: a host that asks for a password or an unknown host key
is an error, not a prompt. A host that hydra starts without a launcher (it is this
machine: ``localhost``, this host's name, or one of its addresses) is read here directly.
Over ssh the check, hydra and the clean-up share one connection per host
(:mod:`distgraph.runtime.launch.connections`).

Example::

    launcher = Launcher.from_env(os.environ)
    with Masters.for_launcher(launcher) as masters:
        shared = launcher.sharing(masters.folder) if masters.folder else launcher
        preflight(shared, ["node0", "node1"], ["train.py"], masters=masters)  # PlanError
        ...                                     # hydra, with shared.hydra_env(env)
"""

from __future__ import annotations

import io
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from distgraph.errors import PlanError
from distgraph.runtime.launch import hostside
from distgraph.runtime.launch.connections import Masters

HOSTSIDE = os.path.abspath(hostside.__file__)
CONNECT_TIMEOUT = 10        # seconds ssh waits for a host's answer
CHECK_TIMEOUT = 60          # seconds for every host's check together
COLLECT_TIMEOUT = 60        # seconds for every host's clean-up and logs together
SLURM_VARS = (("SLURM_JOB_NODELIST", "SLURM_NODELIST"), ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
              ("SLURM_TASKS_PER_NODE",))
SUPPORTED = ("ssh", "rsh", "slurm")


@dataclass(frozen=True)
class Launcher:
    """How hydra reaches other hosts: ``kind`` (ssh, rsh, slurm), ``program`` and the
    ``extra`` arguments after it; over ssh, ``control`` is the ControlPath of the job's
    shared connections (:mod:`distgraph.runtime.launch.connections`), if any."""

    kind: str
    program: str
    extra: tuple[str, ...] = ()
    control: str | None = None

    @classmethod
    def from_env(cls, env) -> "Launcher":
        kind = env.get("HYDRA_LAUNCHER") or env.get("HYDRA_BOOTSTRAP")
        if not kind:
            in_slurm = env.get("HYDRA_RMK") == "slurm" or (
                not env.get("HYDRA_RMK") and all(any(env.get(v) for v in group)
                                                 for group in SLURM_VARS))
            kind = "slurm" if in_slurm else "ssh"
        if kind not in SUPPORTED:
            raise PlanError(f"HYDRA_LAUNCHER={kind}: distgraph run checks the hosts before "
                            f"the ranks start and cleans them after, through {', '.join(SUPPORTED)} "
                            "only; use one of them, or start the job with mpiexec yourself")
        program = (env.get("HYDRA_LAUNCHER_EXEC") or env.get("HYDRA_BOOTSTRAP_EXEC")
                   or {"ssh": "ssh", "rsh": "rsh", "slurm": "srun"}[kind])
        return cls(kind, program, tuple(env.get("HYDRA_LAUNCHER_EXTRA_ARGS", "").split()))

    def argv(self, host: str, command: list[str], master: bool = False) -> list[str]:
        """The command line that runs ``command`` on ``host`` (as the master of its
        shared connection with ``master``)."""
        if self.kind == "slurm":
            # --overlap: a step beside hydra's (a probe while the ranks run) or inside one
            # (distgraph run under srun) starts at once instead of waiting for its CPUs
            return [self.program, "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--quiet",
                    "--overlap", *command]
        options = ["-x", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}"] \
            if self.kind == "ssh" else []
        if master:
            options += ["-o", "ControlMaster=yes", "-o", f"ControlPath={self.control}",
                        "-o", "ControlPersist=no"]
        else:
            options += self._shared()
        return [self.program, *options, *self.extra, host, shlex.join(command)]

    def _shared(self) -> list[str]:
        """The options of a session over the shared connection."""
        if self.control is None:
            return []
        return ["-o", f"ControlPath={self.control}", "-o", "ControlMaster=no"]

    def sharing(self, folder: str) -> "Launcher":
        """This launcher with the shared connections whose sockets are in ``folder``."""
        return replace(self, control=os.path.join(folder, "%C")) if self.kind == "ssh" else self

    def hydra_env(self, env) -> dict:
        """What hydra's environment needs: over ssh, for its ssh to share the connections
        too, ``HYDRA_LAUNCHER_EXTRA_ARGS`` (``env``'s own kept first); through Slurm,
        ``SLURM_OVERLAP`` for its srun (see :meth:`argv`: the ranks' step shares the CPUs
        of the step distgraph run may itself run in)."""
        if self.kind == "slurm":
            return {"SLURM_OVERLAP": "1"}
        if self.control is None:
            return {}
        own = env.get("HYDRA_LAUNCHER_EXTRA_ARGS", "").strip()
        return {"HYDRA_LAUNCHER_EXTRA_ARGS": " ".join([own, *self._shared()]).strip()}

    def __str__(self):
        return self.program if self.kind != "slurm" else f"{self.program} (Slurm)"


def is_local(host: str) -> bool:
    """Whether ``host`` is this machine (hydra then starts its ranks without a launcher):
    ``localhost``, this host's name, or a name whose address belongs to this machine."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        infos = socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.bind((address[0], 0))       # only an address of this machine binds
            return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class Answer:
    """What a command on one host gave: exit code (None: no answer in time), output."""

    host: str
    returncode: int | None
    stdout: bytes
    stderr: str

    def said(self) -> str:
        text = " | ".join(ln.strip() for ln in self.stderr.splitlines() if ln.strip())
        return text[-300:] or f"exit code {self.returncode}"


def run_everywhere(launcher: Launcher, commands: dict, timeout: float,
                   masters: Masters | None = None) -> dict:
    """Run ``commands`` (host -> argv; host None: here, without a launcher) at once;
    host -> :class:`Answer`. With ``masters`` (and a launcher that shares connections),
    each command on another host runs as its connection's master and counts as done
    with its first line of output (see :meth:`Masters.start`)."""
    deadline = time.monotonic() + timeout

    def one(item):
        host, command = item
        if host is not None and masters is not None and launcher.control is not None:
            argv = launcher.argv(host, command, master=True)
            return host, Answer(host, *masters.start(host, argv, deadline))
        argv = command if host is None else launcher.argv(host, command)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True)
        except OSError as err:
            return host, Answer(host, 127, b"", f"cannot run {argv[0]}: {err.strerror}")
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            return host, Answer(host, None, out, err.decode(errors="replace"))
        return host, Answer(host, proc.returncode, out, err.decode(errors="replace"))

    with ThreadPoolExecutor(max_workers=min(32, len(commands) or 1)) as pool:
        return dict(pool.map(one, commands.items()))


def preflight(launcher: Launcher, hosts, files, cwd: str | None = None,
              masters: Masters | None = None) -> None:
    """Before any rank starts: reach every host and compare it with this one (the same
    Python and distgraph at the same paths, the working directory, ``files``: the
    script, the cluster file). Raises PlanError with one line per host that does not
    answer or differs. With ``masters``, each check opens its host's shared connection
    and keeps it (:mod:`distgraph.runtime.launch.connections`)."""
    cwd = cwd or os.getcwd()
    check = [sys.executable, HOSTSIDE, "check", cwd, *files]
    held = check if masters is None or launcher.control is None else \
        [sys.executable, HOSTSIDE, "check", "--hold", cwd, *files]
    commands = {None: check}
    commands.update({h: held for h in dict.fromkeys(hosts) if not is_local(h)})
    answers = run_everywhere(launcher, commands, CHECK_TIMEOUT, masters)
    here = _description(answers.pop(None))
    if here is None:
        raise PlanError(f"cannot describe this host for the comparison: "
                        f"{sys.executable} {HOSTSIDE} check failed")
    problems = [_difference(here, answer, launcher, cwd) for answer in answers.values()]
    problems = [p for p in problems if p]
    if problems:
        raise PlanError("no rank was started; these hosts cannot run the job:\n"
                        + "\n".join(f"  {p}" for p in problems))


def _description(answer: Answer) -> dict | None:
    if answer.returncode != 0:
        return None
    try:
        return json.loads(answer.stdout.decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _difference(here: dict, answer: Answer, launcher: Launcher, cwd: str) -> str | None:
    """The one line about ``answer``'s host, or None when it matches ``here``."""
    host = answer.host
    if answer.returncode is None:
        return f"{host}: no answer over {launcher} within {CHECK_TIMEOUT} s"
    there = _description(answer)
    if there is None:
        if answer.returncode == 255 and launcher.kind == "ssh":
            return f"{host}: not reachable over ssh in batch mode ({answer.said()})"
        return (f"{host}: cannot run {here['python']} with distgraph there (the same Python "
                f"and distgraph must be at the same paths on every host): {answer.said()}")
    if there["python_version"] != here["python_version"]:
        return (f"{host}: Python {there['python_version']} at {here['python']}, this host "
                f"has Python {here['python_version']}")
    if there["package"] != here["package"]:
        return (f"{host}: distgraph is imported from {there['package']}, on this host from "
                f"{here['package']}; install it at the same path on every host")
    if there["distgraph"] != here["distgraph"]:
        return (f"{host}: distgraph {there['distgraph']} at {there['package']}, this host "
                f"has distgraph {here['distgraph']}; install the same version on every host")
    if not there["cwd"]:
        return f"{host}: no folder {cwd} (hydra starts the ranks in this working directory)"
    if there["missing"]:
        return (f"{host}: no {', '.join(os.path.join(cwd, f) for f in there['missing'])} "
                "there (the job's files must be at the same paths on every host)")
    return None


def collect(launcher: Launcher, hosts, status_dir: str, marker: str,
            masters: Masters | None = None) -> list[str]:
    """After a job: on every other host, kill what is left of it, bring its status files
    into ``status_dir`` (logs into ``status_dir/logs``) and remove its folder there.
    Returns one line per host that could not be cleaned or read. A host with a master
    in ``masters`` is asked through it (:meth:`Masters.ask`), over ssh where that fails."""
    command = [sys.executable, HOSTSIDE, "collect", status_dir, marker]
    remote = [h for h in dict.fromkeys(hosts) if not is_local(h)]
    answers = {}
    if masters is not None:
        deadline = time.monotonic() + COLLECT_TIMEOUT
        with ThreadPoolExecutor(max_workers=min(32, len(remote) or 1)) as pool:
            tars = pool.map(lambda h: masters.ask(h, ["collect", status_dir, marker],
                                                  deadline), remote)
            answers = {h: Answer(h, 0, tar, "") for h, tar in zip(remote, tars)
                       if tar is not None}
    rest = {h: command for h in remote if h not in answers}
    answers.update(run_everywhere(launcher, rest, COLLECT_TIMEOUT) if rest else {})
    problems = []
    for host, answer in answers.items():
        if answer.returncode != 0:
            problems.append(f"{host}: could not stop the job's processes and bring back "
                            f"its logs ({answer.said()}); look for {status_dir} there")
            continue
        try:
            with tarfile.open(fileobj=io.BytesIO(answer.stdout), mode="r|") as tar:
                _extract(tar, status_dir)
        except (tarfile.TarError, OSError) as err:
            problems.append(f"{host}: its status files and logs arrived damaged ({err})")
    return problems


def _extract(tar, folder: str) -> None:
    # Pythons with tarfile's extraction filters refuse links and paths out of the folder
    if hasattr(tarfile, "data_filter"):
        tar.extractall(folder, filter="data")
    else:
        tar.extractall(folder)


def move_logs(status_dir: str, log_dir: str) -> None:
    """The ranks' logs (and other files they left in the log folder) from
    ``status_dir/logs`` into ``log_dir``."""
    folder = os.path.join(status_dir, "logs")
    if not os.path.isdir(folder):
        return
    os.makedirs(log_dir, exist_ok=True)
    for name in os.listdir(folder):
        shutil.move(os.path.join(folder, name), os.path.join(log_dir, name))
