"""Names of the data transports, which a client may use, and how a host is recognised.

A node offers transports in its HELLO reply and its etcd record: {"shm": {...}, "ucx": {...}};
TCP is always there. A client takes, per node, the first of PREFERENCE that both sides
allow and that works.
"""

import functools
import os
import socket

SHM, UCX, TCP = "shm", "ucx", "tcp"
PREFERENCE = (SHM, UCX, TCP)
ENV = "KVPOOL_TRANSPORTS"


def parse(text: str | None) -> tuple[str, ...]:
    """"tcp,shm" -> ("shm", "tcp") (always in preference order); None or "" -> every transport.

    This restricts the paths value bytes may take: with "shm" alone a node on another host
    cannot be reached. The node's small requests (and shm's control messages) still use its
    TCP connection.
    """
    if not text or not text.strip():
        return PREFERENCE
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PREFERENCE]
    if unknown:
        raise ValueError(f"unknown transport(s) {', '.join(unknown)}; choose from {', '.join(PREFERENCE)}")
    if not names:
        raise ValueError("no transport named")
    return tuple(name for name in PREFERENCE if name in names)


def from_environment() -> tuple[str, ...]:
    return parse(os.environ.get(ENV))


@functools.cache
def host_id() -> str:
    """Same on every process of this machine (boot), different on any other: two processes
    that agree on it can share memory through /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"
