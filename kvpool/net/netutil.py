"""Small socket helpers: loopback ports for local processes, connecting, and the options of long-lived
TCP connections."""

import asyncio
import ipaddress
import os
import socket
import ssl
import time

from ..errors import KvpoolError


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, interval: float = 0.05, what: str = "condition"):
    """Poll `predicate` until it returns a truthy value; TimeoutError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


# A peer that goes silent (a partition: packets vanish, nothing answers) is found by the clock rather than
# by TCP's retransmission back-off, which keeps a dead connection for minutes and, after a heal, resumes
# only at its next retry (tens of seconds): unacknowledged data older than SILENT_PEER_SECONDS ends the
# connection (TCP_USER_TIMEOUT), and an idle one is probed from KEEPALIVE_IDLE seconds on.
SILENT_PEER_SECONDS = 5.0
KEEPALIVE_IDLE = 2
KEEPALIVE_INTERVAL = 1
_LINUX_OPTIONS = all(hasattr(socket, name) for name in ("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT",
                                                        "TCP_USER_TIMEOUT"))


def long_lived(sock: socket.socket, silent_after: float = SILENT_PEER_SECONDS) -> socket.socket:
    """Set the options of a long-lived TCP connection on `sock`: Nagle off, keepalive probes, and a
    silent peer dropped after `silent_after` seconds (the connection then fails with ETIMEDOUT)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    if _LINUX_OPTIONS:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT,
                        max(1, int((silent_after - KEEPALIVE_IDLE) / KEEPALIVE_INTERVAL)))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(silent_after * 1000))
    return sock


async def open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket with long_lived's options (a host name is resolved off the loop
    thread); OSError if it cannot connect. Bound it with a timeout."""
    loop = asyncio.get_running_loop()
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        target = (host, port)
    except ValueError:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, _, _, _, target = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        long_lived(sock)
        await loop.sock_connect(sock, target)
    except BaseException:
        sock.close()
        raise
    return sock


def connect_failure(exc: BaseException, what: str, error_type, timeout: float | None = None) -> BaseException | None:
    """What to raise for a connection attempt (connect, TLS and AUTH handshakes) that failed with `exc`: a
    timeout or an OS error (refused, unreachable, TLS) as `error_type` naming `what`; None to raise `exc`
    itself (a kvpool error, e.g. a refused credential, or a cancellation)."""
    if isinstance(exc, KvpoolError):  # some are OSErrors too (UnavailableError, ForbiddenError)
        return None
    if isinstance(exc, TimeoutError):
        return error_type(f"{what}: connect timed out" + (f" after {timeout}s" if timeout else ""))
    if isinstance(exc, OSError):
        # (an SSLError's errno is the TLS library's, not the system's)
        reason = os.strerror(exc.errno) if exc.errno and not isinstance(exc, ssl.SSLError) else str(exc)
        return error_type(f"{what}: cannot connect: {reason}")
    return None


class ConnectAttempt:
    """`with ConnectAttempt(what, error_type, timeout) as attempt:` around the steps of opening a
    connection (connect, TLS, AUTH), setting `attempt.sock` once there is one: if a step fails, that
    socket is closed and the failure raised as connect_failure says."""

    def __init__(self, what: str, error_type, timeout: float | None = None):
        self.what = what
        self.error_type = error_type
        self.timeout = timeout
        self.sock = None  # closed if the attempt fails; None once something else owns it

    def __enter__(self) -> "ConnectAttempt":
        return self

    def __exit__(self, _kind, exc, _traceback) -> bool:
        if exc is None:
            return False
        if self.sock is not None:
            self.sock.close()
        failure = connect_failure(exc, self.what, self.error_type, self.timeout)
        if failure is None:
            return False  # `exc` goes on as it was
        raise failure from None
