"""The node connections' frames (the client's TcpTransport, the member's TcpLink), checked byte for byte by a
small scripted peer on a real socket.

The peer parses every request the way the wire contract describes it and answers
from a dict, so these tests pin down what the client sends (options block, flags,
HOLD's arg) and how it reads every kind of reply, independently of the node.
"""

import asyncio
import json

import pytest

from kvpool.security import auth
from kvpool.protocol import inventory, wire
from kvpool.protocol.checksum import checksum
from kvpool.client.tcp import TcpTransport
from kvpool.net.node_connections import NodeConnections
from kvpool.net.tcp_link import TcpLink
from kvpool.client.transport import ReadItem, WriteItem, WriteOptions
from kvpool.errors import Code, KeyNotFoundError, NoSpaceError, ProtocolError


class ScriptedNode:
    """Keeps (key, generation) -> bytes; logs every request as a dict."""

    def __init__(self, report_body: bytes = b'{"node_id": "peer", "tiers": {}, "evicted": []}'):
        self.objects: dict[tuple, bytes] = {}
        self.log: list[dict] = []
        self.report_body = report_body
        self.server = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer) -> None:
        try:
            await self._handshake(reader, writer)
            while True:
                header = await reader.readexactly(wire.REQUEST.size)
                _m, _v, op, req_id, key_len, flags, generation, arg, length, digest = wire.REQUEST.unpack(header)
                key = await reader.readexactly(key_len)
                entry = {"op": op, "key": key, "generation": generation, "arg": arg, "flags": flags,
                         "length": length}
                self.log.append(entry)
                ident = (key, generation)
                if op == wire.Op.WRITE:
                    entry["ttl_ms"], entry["soft_pin_ms"], entry["raw_size"], entry["seal"] = wire.WRITE_OPTIONS.unpack(
                        await reader.readexactly(wire.WRITE_OPTIONS.size))
                    data = await reader.readexactly(length)
                    if key == b"full":
                        writer.write(wire.pack_error(op, req_id, Code.NO_SPACE, "no room"))
                    else:
                        assert checksum(data) == digest
                        self.objects[ident] = data
                        writer.write(wire.pack_reply(op, req_id, Code.OK))
                elif op == wire.Op.READ:
                    data = self.objects.get(ident)
                    if data is None:
                        writer.write(wire.pack_error(op, req_id, Code.NOT_FOUND, "not held"))
                    else:
                        writer.write(wire.pack_reply(op, req_id, Code.OK, len(data), checksum(data)) + data)
                elif op in (wire.Op.FREE, wire.Op.HOLD):
                    held = (self.objects.pop(ident, None) if op == wire.Op.FREE else self.objects.get(ident))
                    status = Code.OK if held is not None else Code.NOT_FOUND
                    writer.write(wire.pack_reply(op, req_id, status))
                elif op == wire.Op.REPORT:
                    writer.write(wire.pack_reply(op, req_id, Code.OK, len(self.report_body)) + self.report_body)
                elif op == wire.Op.INVENTORY:
                    body = inventory.encode([inventory.Entry(k.decode(), g, len(v), 0)
                                             for (k, g), v in sorted(self.objects.items())])
                    writer.write(wire.pack_reply(op, req_id, Code.OK, len(body)) + body)
                elif op == wire.Op.PING:
                    writer.write(wire.pack_reply(op, req_id, Code.OK, 4) + b"peer")
                await writer.drain()
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()


    @staticmethod
    async def _handshake(reader, writer) -> None:
        """The server's side of kvpool/security/auth.py, with this run's cluster secret."""
        handshake = auth.ServerHandshake(auth.Verifier(auth.read_token()))
        writer.write(handshake.challenge())
        header = await reader.readexactly(wire.REQUEST.size)
        _m, _v, op, req_id, key_len, role, _g, _a, length, _d = wire.REQUEST.unpack(header)
        payload = await reader.readexactly(key_len + length)
        writer.write(handshake.answer(op, req_id, payload[:key_len], role, length, payload[key_len:])[1])


async def ping(link: TcpLink, address: str) -> str:
    """PING (served to any peer) on the link's connection to `address`: the node's id."""
    connection = await link.connection(address)
    return await connection.request(wire.Op.PING, b"", 0, 0, 0)


def run(scenario, link=TcpTransport, **node_options):
    """scenario(transport, address, node) against a scripted node, through a `link` (the client's
    TcpTransport, or the member's TcpLink) holding the member credential."""
    async def main():
        node = ScriptedNode(**node_options)
        address = await node.start()
        transport = link(credential=auth.Credential.for_member(auth.read_token()))
        try:
            return await scenario(transport, address, node)
        finally:
            await transport.close()
            await node.stop()
    return asyncio.run(main())


def test_write_sends_options_block_and_read_returns_checksum():
    async def scenario(transport, address, node):
        data = memoryview(b"stored bytes")
        options = WriteOptions(flags=wire.WriteFlag.PREFER_SSD | wire.WriteFlag.COMPRESSED,
                               ttl_ms=1500, soft_pin_ms=0, raw_size=4096)
        await transport.write(address, b"k", 11, data, checksum(data), options)
        await transport.write(address, b"plain", 12, data, checksum(data))
        buf = bytearray(len(data))
        digest = await transport.read_into(address, b"k", 11, memoryview(buf))
        assert bytes(buf) == b"stored bytes" and digest == checksum(data)
        first, second = node.log[0], node.log[1]
        assert first["flags"] == wire.WriteFlag.PREFER_SSD | wire.WriteFlag.COMPRESSED
        assert (first["ttl_ms"], first["soft_pin_ms"], first["raw_size"], first["arg"]) == (1500, 0, 4096, 0)
        # Without options: no flags, no expiry, raw size = stored size.
        assert (second["flags"], second["ttl_ms"], second["soft_pin_ms"], second["raw_size"]) == (0, 0, 0, len(data))
        with pytest.raises(KeyNotFoundError, match="not held"):
            await transport.read_into(address, b"k", 99, memoryview(bytearray(len(data))))

    run(scenario)


def test_pipelined_batches_keep_per_item_results():
    async def scenario(transport, address, node):
        values = [bytes([i]) * (1000 + i) for i in range(20)]
        items = [WriteItem(b"key%d" % i, i + 1, memoryview(v), checksum(v),
                           WriteOptions(flags=wire.WriteFlag.HARD_PIN) if i % 2 else None)
                 for i, v in enumerate(values)]
        assert await transport.write_many(address, items) == [None] * 20
        assert [e["flags"] for e in node.log] == [wire.WriteFlag.HARD_PIN if i % 2 else 0 for i in range(20)]
        bufs = [bytearray(len(v)) for v in values]
        reads = [ReadItem(b"key%d" % i, i + 1, memoryview(b)) for i, b in enumerate(bufs)]
        reads.append(ReadItem(b"key0", 999, memoryview(bytearray(1000))))
        results = await transport.read_many(address, reads)
        assert results[:20] == [checksum(v) for v in values]
        assert isinstance(results[20], KeyNotFoundError)
        assert bufs == [bytearray(v) for v in values]

    run(scenario)


def test_free_hold_inventory_report_ping():
    async def scenario(transport, address, node):
        data = memoryview(b"abc")
        await transport.write(address, b"a", 1, data, checksum(data))
        await transport.write(address, b"b", 2, data, checksum(data))
        assert await transport.hold(address, b"a", 1, 2500) is True
        assert await transport.hold(address, b"a", 7, 2500) is False
        assert node.log[2]["op"] == wire.Op.HOLD and node.log[2]["arg"] == 2500
        assert [(e.key, e.generation, e.size) for e in await transport.inventory(address)] == [
            ("a", 1, 3), ("b", 2, 3)]
        assert await transport.free(address, b"a", 1) is True
        assert await transport.free(address, b"a", 1) is False
        assert [e.key for e in await transport.inventory(address)] == ["b"]
        assert (await transport.report(address))["node_id"] == "peer"
        assert await ping(transport, address) == "peer"

    run(scenario, link=TcpLink)


def test_the_client_transport_sends_no_member_request():
    """FREE, HOLD, REPORT, INVENTORY, EVICTIONS, COPY and PING are a member's (kvpool/net/tcp_link.py),
    out of the client's transport contract; the connections and WRITE are shared, written once."""
    member_only = ("free", "hold", "report", "inventory", "evictions", "copy")
    assert [name for name in member_only if hasattr(TcpTransport, name)] == []
    assert all(callable(getattr(TcpLink, name)) for name in member_only)
    assert TcpTransport._open is TcpLink._open and TcpLink.write is NodeConnections.write


def test_unreadable_report_fails_that_call_only():
    async def scenario(transport, address, node):
        with pytest.raises(ProtocolError, match="not JSON"):
            await transport.report(address)
        assert await ping(transport, address) == "peer"  # the connection survived

    run(scenario, link=TcpLink, report_body=b"{broken")


def test_error_reply_to_a_write_is_typed():
    async def scenario(transport, address, node):
        data = memoryview(b"xyz")
        with pytest.raises(NoSpaceError, match="no room"):
            await transport.write(address, b"full", 1, data, checksum(data))

    run(scenario)
