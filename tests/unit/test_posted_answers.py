"""The master's control port holds the answer to a posted call (control.POSTED) back to leave with its next
reply, or after control.HOLD_POSTED: the real ControlPort connection and MasterService, driven in-process
with a transport that records what is written."""

import asyncio

from kvpool.master.serving import control_port
from kvpool.master.serving.control_port import ControlPort
from kvpool.master.serving.metrics import MasterMetrics
from kvpool.master.table.objects import ObjectTable
from kvpool.master.serving.service import MasterService
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol import control, wire
from kvpool.protocol.cluster_layout import NodeRecord, TierRecord
from async_wait import until


class _Recorded(asyncio.Transport):
    """What the connection writes, in order."""

    def __init__(self):
        super().__init__()
        self.writes: list[bytes] = []

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...


def _req_ids(data: bytes) -> list[int]:
    ids, at = [], 0
    while at < len(data):
        fields = wire.REPLY.unpack_from(data, at)
        ids.append(fields[3])
        at += wire.REPLY.size + fields[6]
    return ids


def _call(method: str, req_id: int, request, flags: int = 0) -> bytes:
    return control.pack_call(control.OP_BY_RPC[method], req_id, request.SerializeToString(), flags)


def test_a_posted_answer_rides_with_the_next_reply_or_leaves_on_its_own_soon_after():
    async def scenario():
        table = ObjectTable(first_generation=1)
        table.upsert_node(NodeRecord("n1", "i1", "127.0.0.1", 9001, tiers={"dram": TierRecord(1 << 30)}))
        port = ControlPort(MasterService(table, None, MasterMetrics(table), "m", "127.0.0.1:1"))
        started = table.put_start_many(["a", "b"], [10, 10], [1, 1])
        connection = control_port._Connection(port)
        transport = _Recorded()
        connection.connection_made(transport)
        transport.writes.clear()  # the handshake's challenge (an open port asks nothing more)

        connection.data_received(_call("BatchPutEnd", 1, pb.BatchPutEndRequest(
            keys=["a"], generations=[started[0].generation]), control.POSTED))
        assert transport.writes == []  # held
        connection.data_received(_call("BatchExists", 2, pb.BatchExistsRequest(keys=["a", "b"])))
        assert len(transport.writes) == 1 and _req_ids(transport.writes[0]) == [1, 2]  # one write, posted first
        transport.writes.clear()

        connection.data_received(_call("BatchPutEnd", 3, pb.BatchPutEndRequest(
            keys=["b"], generations=[started[1].generation]), control.POSTED))
        assert transport.writes == []
        await until(lambda: transport.writes, interval=0.0005)  # nothing to ride with: it leaves after HOLD_POSTED
        assert _req_ids(b"".join(transport.writes)) == [3]
        transport.writes.clear()

        connection.data_received(_call("BatchExists", 4, pb.BatchExistsRequest(keys=["a", "b"])))
        (reply,) = transport.writes  # a call not posted is answered at once
        assert _req_ids(reply) == [4]
        assert list(pb.BatchExistsResponse.FromString(reply[wire.REPLY.size:]).exists) == [True, True]
        connection.connection_lost(None)

    asyncio.run(scenario())
