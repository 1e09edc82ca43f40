"""A lookup in its lean frame (Op.LOOKUP: keys joined by NUL, a byte per key answered) answers what BatchExists
answers, through the real ControlPort connection and MasterService; and a client whose master predates it
(a control port without the op) asks BatchExists instead, over a real socket."""

import asyncio
import threading

from kvpool.client.waiting import BlockingIO
from kvpool.client.master_link import MasterLink
from kvpool.errors import Code
from kvpool.master.serving import control_port
from kvpool.master.serving.control_port import ControlPort
from kvpool.master.serving.metrics import MasterMetrics
from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.objects import ObjectTable
from kvpool.master.serving.service import MasterService
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol import control, wire

from async_wait import until
from test_objects import put, record
from test_posted_answers import _Recorded, _call, _req_ids


def _lookup(req_id: int, keys: list) -> bytes:
    return control.pack_call(wire.Op.LOOKUP, req_id, control.pack_keys(keys))


def _replies(data: bytes) -> list[tuple[int, int, bytes]]:
    """(req_id, status, body) of each reply frame in data."""
    found, at = [], 0
    while at < len(data):
        fields = wire.REPLY.unpack_from(data, at)
        end = at + wire.REPLY.size + fields[6]
        found.append((fields[3], fields[4], data[at + wire.REPLY.size:end]))
        at = end
    return found


def _table() -> ObjectTable:
    table = ObjectTable(first_generation=1)
    table.upsert_node(record("n1"))
    return table


def test_a_lookup_answers_as_batch_exists_through_posted_ends_and_removals():
    async def scenario():
        table = _table()
        port = ControlPort(MasterService(table, NodeIO(), MasterMetrics(table), "m", "127.0.0.1:1"))
        started = table.put_start_many(["a", "b"], [10, 10], [1, 1])
        connection = control_port._Connection(port)
        transport = _Recorded()
        connection.connection_made(transport)
        transport.writes.clear()
        keys = ["a", "b", "c", "a"]

        # A posted end kept to fold later is seen by the lookup that follows it, whose reply it rides with.
        connection.data_received(_call("BatchPutEnd", 1, pb.BatchPutEndRequest(
            keys=["a"], generations=[started[0].generation]), control.POSTED))
        connection.data_received(_lookup(2, keys))
        (written,) = transport.writes
        assert _req_ids(written) == [1, 2]
        assert _replies(written)[1] == (2, Code.OK, b"\x01\x00\x00\x01")
        transport.writes.clear()

        connection.data_received(_call("BatchExists", 3, pb.BatchExistsRequest(keys=keys)))
        connection.data_received(_lookup(4, keys))
        (batch_exists, lookup) = [_replies(w)[0] for w in transport.writes]
        assert list(pb.BatchExistsResponse.FromString(batch_exists[2]).exists) == [True, False, False, True]
        assert control.parse_found(lookup[2]) == [True, False, False, True]
        transport.writes.clear()

        # The replica a removal released is freed (no node answers here) before the next call's answer
        # leaves: the lookup finishes as a coroutine, and is answered the same.
        table.remove("a")
        connection.data_received(_lookup(5, keys))
        await until(lambda: transport.writes, seconds=10)
        assert _replies(transport.writes.pop()) == [(5, Code.OK, b"\x00\x00\x00\x00")]

        # A bad key refuses the call with its index; a body not in UTF-8 is refused; the connection serves on.
        connection.data_received(_lookup(6, ["a", ""]) + control.pack_call(wire.Op.LOOKUP, 7, b"\xff\x00a")
                                 + _lookup(8, ["b"]))
        (bad_key, not_utf8, fine) = _replies(b"".join(transport.writes))
        assert bad_key[:2] == (6, Code.INVALID_KEY) and bad_key[2].startswith(b"keys[1]: ")
        assert not_utf8[:2] == (7, Code.INVALID_ARGUMENT)
        assert fine == (8, Code.OK, b"\x00")
        assert port.requests.counts[(control.LOOKUP,)] == 5
        connection.connection_lost(None)

    asyncio.run(scenario())


class _ServedPort:
    """A ControlPort on a real socket, its loop in a thread of its own."""

    def __init__(self, knows_lookup: bool):
        self.loop = asyncio.new_event_loop()
        table = _table()
        self.table = table
        self.port = ControlPort(MasterService(table, None, MasterMetrics(table), "m", "127.0.0.1:1"))
        if not knows_lookup:  # as a master from before Op.LOOKUP: an unknown op, answered PROTOCOL
            del self.port.entries[int(wire.Op.LOOKUP)]
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.number = self._run(self._bind())

    async def _bind(self) -> int:
        number = await self.port.bind("127.0.0.1", 0)
        await self.port.start()
        return number

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self._run(self.port.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


def _asked(served: _ServedPort) -> tuple[int, int]:
    counts = served.port.requests.counts
    return counts[(control.LOOKUP,)], counts[("BatchExists",)]


def test_a_master_that_predates_lookup_is_asked_batch_exists_from_then_on():
    for knows_lookup in (True, False):
        served = _ServedPort(knows_lookup)
        io = BlockingIO()
        try:
            served._run(_put(served.table, "here"))
            link = MasterLink("127.0.0.1:1", io=io, rpc_timeout=5)
            link._controls[link.address] = f"127.0.0.1:{served.number}"  # as learnt from its Stats
            keys = ["here", "gone"]
            for _ in range(2):
                answered = link.lookup_now(keys, lambda: pb.BatchExistsRequest(keys=keys))
                found = answered if knows_lookup else list(answered.exists)
                assert found == [True, False]
            assert link.lookups is knows_lookup
            # A master that knows it is asked LOOKUP only; an older one once, then BatchExists.
            assert _asked(served) == ((2, 0) if knows_lookup else (0, 2))
            assert served.port.refused.labels("protocol")._value.get() == (0 if knows_lookup else 1)
            io.run(link.close())
        finally:
            io.close()
            served.close()


def test_an_async_lookup_asks_a_master_that_predates_it_batch_exists_from_then_on():
    """AsyncClient's path (MasterLink.lookup): the same frame and the same fallback as the blocking one."""
    for knows_lookup in (True, False):
        served = _ServedPort(knows_lookup)
        try:
            served._run(_put(served.table, "here"))

            async def scenario():
                link = MasterLink("127.0.0.1:1", rpc_timeout=5)
                link._controls[link.address] = f"127.0.0.1:{served.number}"  # as learnt from its Stats
                keys = ["here", "gone"]
                try:
                    for _ in range(2):
                        answered = await link.lookup(keys, lambda: pb.BatchExistsRequest(keys=keys))
                        found = answered if knows_lookup else list(answered.exists)
                        assert found == [True, False]
                    assert link.lookups is knows_lookup
                finally:
                    await link.close()

            asyncio.run(scenario())
            assert _asked(served) == ((2, 0) if knows_lookup else (0, 2))
        finally:
            served.close()


async def _put(table: ObjectTable, key: str) -> None:
    put(table, key)  # on the port's loop, as every change to its table
