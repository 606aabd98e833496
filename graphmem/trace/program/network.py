"""graphmem run: the program's network connections refused (a pre-flight talks to no server).

Input: whether the user allowed the network (``--allow-network``).  Output: ``without_network``,
a context manager under which a socket of the program's that connects or sends to an address
(IPv4, IPv6: a server, a loopback service, a DNS lookup made from Python) gets
``ConnectionRefusedError`` naming the option; local sockets (``AF_UNIX``: multiprocessing's
own) work.  Python's ``socket`` module only: a C library opening sockets itself (gRPC's core,
libcurl) is not stopped, nor a subprocess.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from collections.abc import Iterator
from typing import Any

from graphmem.patching import patched

__all__ = ["without_network"]

_REFUSED = ("graphmem run: the program's network connections are off during a pre-flight ({}); "
            "give graphmem run --allow-network to let it connect")


def _refusing(name: str) -> Any:
    original = getattr(socket.socket, name)

    def call(self: socket.socket, *args: Any, **kwargs: Any) -> Any:
        if self.family == getattr(socket, "AF_UNIX", None):
            return original(self, *args, **kwargs)
        where = args[-1] if args else kwargs.get("address", "?")
        if name == "connect_ex":  # answers with an error number, as a refused connection does
            return errno.ECONNREFUSED
        raise ConnectionRefusedError(errno.ECONNREFUSED, _REFUSED.format(f"{name} to {where!r}"))

    return call


@contextlib.contextmanager
def without_network(allowed: bool) -> Iterator[None]:
    """Inside, the program's sockets connect and send to no address unless ``allowed``."""
    if allowed:
        yield
        return
    names = ("connect", "connect_ex", "sendto", "sendmsg")
    with patched(*((socket.socket, name, _refusing(name)) for name in names)):
        yield
