"""Loopback ports for the servers and process groups alignflow starts."""

import contextlib
import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: each socket stays bound until all are picked, because
    ports asked for one at a time can come back twice (a Ray head refuses to start then)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
