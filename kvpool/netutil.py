"""Small socket helpers: loopback ports for local processes, and connecting."""

import asyncio
import ipaddress
import socket
import time


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



async def open_socket(host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket with Nagle off (a host name is resolved off the loop thread);
    OSError if it cannot connect. Bound it with a timeout."""
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
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await loop.sock_connect(sock, target)
    except BaseException:
        sock.close()
        raise
    return sock
