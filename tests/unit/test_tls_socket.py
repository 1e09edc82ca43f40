"""kvpool/security/tls_socket.py over a real socket pair: the handshake, bulk and small transfers both ways with the
sockets' buffers full (the encrypted backlog), partial reads, and the end of the stream."""

import asyncio
import hashlib
import os
import socket
import ssl

import pytest

from kvpool.sockets.socket_input import SocketInput
from kvpool.sockets.socket_output import flush_backlog, send_all
from kvpool.security.tls import make_local
from kvpool.security.tls_socket import TlsSocket, handshake


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_local(tmp_path_factory.mktemp("tls"), hosts=["127.0.0.1", "localhost"])


def pair(files):
    a, b = socket.socketpair()
    for sock in (a, b):
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)  # small buffers: the backlog gets used
    server = TlsSocket(a, files.server_context(), server_side=True)
    client = TlsSocket(b, files.client_context(), server_side=False, server_hostname="localhost")
    return server, client


async def receive(sock, size: int, piece: int) -> bytes:
    source, out = SocketInput(sock), bytearray()
    view = memoryview(bytearray(piece))
    try:
        while len(out) < size:
            got = await source.recv_into(view[:min(piece, size - len(out))])
            assert got, "stream ended early"
            out += view[:got]
    finally:
        source.stop()
    return bytes(out)


def test_bulk_and_small_transfers_both_ways(files):
    async def main():
        server, client = pair(files)
        await asyncio.wait_for(asyncio.gather(handshake(server), handshake(client)), 10)
        bulk = os.urandom(5 * 1024 * 1024 + 17)
        sent = asyncio.ensure_future(send_all(client, bulk))
        got = await asyncio.wait_for(receive(server, len(bulk), 65536), 30)
        await asyncio.wait_for(sent, 10)
        assert not client.backlog
        assert hashlib.sha256(got).digest() == hashlib.sha256(bulk).digest()
        frames = [os.urandom(n) for n in (1, 7, 300, 4096, 20000)] * 20

        async def send_frames():
            for frame in frames:
                await send_all(server, frame)

        sending = asyncio.ensure_future(send_frames())
        back = await asyncio.wait_for(receive(client, sum(map(len, frames)), 1000), 30)
        await asyncio.wait_for(sending, 10)
        assert back == b"".join(frames)
        sent = client.sendmsg([b"head", memoryview(b"-and-body")])  # sendmsg's many buffers, in order
        assert sent == 13
        await asyncio.wait_for(flush_backlog(client), 10)  # what was encrypted leaves
        assert await asyncio.wait_for(receive(server, 13, 64), 10) == b"head-and-body"
        client.close()
        buf = bytearray(10)
        source = SocketInput(server)
        assert await asyncio.wait_for(source.recv_into(memoryview(buf)), 10) == 0  # the end of the stream
        source.stop()
        server.close()

    asyncio.run(main())


def test_a_client_refuses_a_certificate_its_ca_did_not_sign(files, tmp_path):
    other = make_local(tmp_path / "other")

    async def main():
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        server = TlsSocket(a, other.server_context(), server_side=True)
        client = TlsSocket(b, files.client_context(), server_side=False, server_hostname="localhost")
        results = await asyncio.wait_for(asyncio.gather(handshake(server), handshake(client),
                                                        return_exceptions=True), 10)
        assert any(isinstance(r, OSError) for r in results)  # ssl.SSLCertVerificationError
        a.close()
        b.close()

    asyncio.run(main())


def test_the_certificates_made_pass_strict_verification(files):
    """Python 3.13's default contexts verify with VERIFY_X509_STRICT (a certificate must name its issuer's key):
    set here on any Python, the member certificate make_local signs is still accepted."""
    async def main():
        a, b = socket.socketpair()
        a.setblocking(False)
        b.setblocking(False)
        strict = files.client_context()
        strict.verify_flags |= ssl.VERIFY_X509_STRICT
        server = TlsSocket(a, files.server_context(), server_side=True)
        client = TlsSocket(b, strict, server_side=False, server_hostname="localhost")
        await asyncio.wait_for(asyncio.gather(handshake(server), handshake(client)), 10)
        a.close()
        b.close()

    asyncio.run(main())
