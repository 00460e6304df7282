"""Whether an emulated machine answers on the network, seen from the job's hub namespace.

A machine answers when a TCP connection to its address gets a reply within the timeout:
a refusal (nothing listens on the port: the kernel answers with a reset) counts, as it
proves the machine's network stack is reachable; silence (its interface is down, its
link cut) does not. The connections are made from a short-lived thread that enters the
hub namespace (``setns(2)`` changes only the calling thread's namespace), so a probe
starts no process and costs a few system calls: the elastic launcher probes every second.

Example (as root, with the job's namespaces up)::

    answering(layout.hub_namespace, ["10.1.2.2", "10.1.2.3"])    # {"10.1.2.2"}
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import socket
import threading
import time

CLONE_NEWNET = 0x40000000
PORT = 9            # discard: nothing listens there in a machine's namespace
TIMEOUT = 0.5


def _enter(namespace: str) -> None:
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace}")
    finally:
        os.close(fd)


def _probe(addresses, timeout: float) -> set[str]:
    socks = {}
    found = set()
    for address in addresses:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        code = s.connect_ex((address, PORT))
        if code in (0, errno.ECONNREFUSED):
            found.add(address)
            s.close()
        elif code == errno.EINPROGRESS:
            socks[s] = address
        else:
            s.close()
    end = time.monotonic() + timeout
    while socks and time.monotonic() < end:
        _, ready, _ = select.select([], list(socks), [], max(0.0, end - time.monotonic()))
        for s in ready:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) in (0, errno.ECONNREFUSED):
                found.add(socks[s])
            s.close()
            del socks[s]
    for s in socks:
        s.close()
    return found


def answering(hub_namespace: str, addresses, timeout: float = TIMEOUT) -> set[str]:
    """The ``addresses`` that answer from ``hub_namespace`` within ``timeout`` seconds."""
    result: dict = {}

    def run():
        try:
            _enter(hub_namespace)
            result["found"] = _probe(list(addresses), timeout)
        except OSError as err:
            result["error"] = err

    thread = threading.Thread(target=run, name="emulated-probe", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["found"]
