"""kvpool/net/netutil.py long_lived: the options every long-lived connection carries, so a silent peer (a
partition: nothing answers) ends the connection after SILENT_PEER_SECONDS instead of TCP's back-off."""

import asyncio
import socket

import pytest

from kvpool.net.netutil import KEEPALIVE_IDLE, SILENT_PEER_SECONDS, long_lived, open_socket

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="Linux socket options")


def _options(sock: socket.socket) -> dict:
    return {"nodelay": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY),
            "keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)}


def test_a_socket_is_given_keepalive_and_a_user_timeout():
    with socket.socket() as sock:
        assert _options(sock)["user_timeout_ms"] == 0  # the kernel's default: the back-off decides
        long_lived(sock, silent_after=3.0)
        assert _options(sock) == {"nodelay": 1, "keepalive": 1, "idle": KEEPALIVE_IDLE, "user_timeout_ms": 3000}


def test_every_connection_open_socket_makes_carries_them():
    async def connect(port: int) -> dict:
        sock = await asyncio.wait_for(open_socket("127.0.0.1", port), 5)
        try:
            return _options(sock)
        finally:
            sock.close()

    with socket.create_server(("127.0.0.1", 0)) as listener:
        options = asyncio.run(connect(listener.getsockname()[1]))
    assert options == {"nodelay": 1, "keepalive": 1, "idle": KEEPALIVE_IDLE,
                       "user_timeout_ms": int(SILENT_PEER_SECONDS * 1000)}
