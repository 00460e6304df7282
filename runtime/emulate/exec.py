"""Hydra's ``-launcher-exec`` for emulated clusters: start a proxy inside a machine's
namespace, under the machine's hostname.

Hydra's ssh launcher runs ``LAUNCHER [-x] HOST 'command ...'``. This script looks HOST
(an emulated machine's address) up in ``$DISTGRAPH_EMULATE_HOSTS`` (JSON: address ->
[namespace, hostname]) and becomes::

    ip netns exec NAMESPACE unshare --uts python exec.py --hostname HOSTNAME 'command ...'

which sets the hostname in the new UTS namespace and runs the command with ``sh -c``, as
ssh would. Where the machine computes slower than the fastest, the helper first moves
itself into the machine's CPU-quota cgroup (``$DISTGRAPH_EMULATE_CGROUPS``: JSON address
-> the group's ``cgroup.procs``), so the proxy and the ranks it starts run under the quota. A separate hostname per machine is what makes MPICH treat the machines as
different nodes (shared memory inside one, the network between them).

It runs as a file, not as ``-m distgraph...``: importing the package would cost every
proxy a second. The launcher writes a two-line shell wrapper that calls it, because
hydra wants one executable path.
"""

from __future__ import annotations

import json
import os
import socket
import sys

HOSTS_VAR = "DISTGRAPH_EMULATE_HOSTS"
GROUPS_VAR = "DISTGRAPH_EMULATE_CGROUPS"


def main(argv: list[str]) -> None:
    if argv[:1] == ["--hostname"]:
        socket.sethostname(argv[1])
        os.execvp("sh", ["sh", "-c", " ".join(argv[2:])])
    if argv[:1] == ["-x"]:
        argv = argv[1:]
    if len(argv) < 2:
        sys.exit("distgraph.runtime.emulate.exec: usage: exec.py [-x] HOST COMMAND...")
    hosts = json.loads(os.environ.get(HOSTS_VAR, "{}"))
    if argv[0] not in hosts:
        sys.exit(f"distgraph.runtime.emulate.exec: host {argv[0]!r} is not an emulated machine of this job "
                 f"(known: {', '.join(sorted(hosts)) or 'none'})")
    namespace, hostname = hosts[argv[0]]
    group = json.loads(os.environ.get(GROUPS_VAR, "{}")).get(argv[0])
    if group is not None:
        with open(group, "w") as f:       # children inherit the group
            f.write(f"{os.getpid()}\n")
    os.execvp("ip", ["ip", "netns", "exec", namespace, "unshare", "--uts", sys.executable,
                     os.path.abspath(__file__), "--hostname", hostname, " ".join(argv[1:])])


if __name__ == "__main__":
    main(sys.argv[1:])
