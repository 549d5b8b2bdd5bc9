"""Free loopback ports for the servers the tests start.

A port from ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range (``ip_local_port_range``,
32768-60999 by default), the same range every outgoing connection takes its source port from: between the
moment such a port is found free and the moment the server binds it, any client connection on the machine (the
suite's own, to its control planes and servers) can take it, and the server fails with ``EADDRINUSE``. So the
ports come from 10000-19999 instead, below the ephemeral range and below ``cluster.sh``'s 20000-31999, and each
test process (pytest-xdist worker ``gwN``) hands out its own tenth of it in turn, so that two processes of one
run never pick the same port. A port is checked free by binding it before it is handed out. Each process starts
at a random port of its share, so that two runs on one machine (two engineers' suites, whose ``gw0`` share the
same tenth) walk it from different places rather than racing for the same ports in the same order.
"""

from __future__ import annotations

import itertools
import os
import random
import re
import socket

PORT_RANGE = range(10000, 20000)
"""Where the suite's servers listen: outside the kernel's ephemeral ports and ``cluster.sh``'s range."""
SHARE = 1000
"""Ports per test process."""


def _share() -> range:
    """This process's ports: worker ``gwN`` gets share N (modulo 10), the controller or a plain run share 0."""
    found = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    index = int(found.group(1)) % (len(PORT_RANGE) // SHARE) if found else 0
    start = PORT_RANGE.start + index * SHARE
    return range(start, start + SHARE)


def _walk() -> itertools.cycle[int]:
    """This process's share in turn, from a random start (see the module docstring)."""
    share = _share()
    start = random.randrange(len(share))
    return itertools.cycle([*share[start:], *share[:start]])


_next = _walk()


def free_port() -> int:
    """A TCP port on 127.0.0.1, from this process's share of :data:`PORT_RANGE`, that nothing is bound to now.

    Raises ``OSError`` when every port of the share is taken.
    """
    for _ in range(SHARE):
        port = next(_next)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port on 127.0.0.1 in {_share().start}-{_share().stop - 1}")
