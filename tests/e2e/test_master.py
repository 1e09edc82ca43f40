"""A real master process against a real etcd, driven over gRPC.

The control-plane tests stand storage nodes in by their registration alone (a
NodeRecord under a lease, written here): the master only ever sees nodes through
etcd, and no bytes move. The tests at the end run real storage nodes, and move
bytes to them over the data protocol as a client does, to check what the master
learns from them (REPORT, INVENTORY) and what it tells them (HOLD).
"""

import asyncio
import json
import queue
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvpool.protocol import cluster_layout
from kvpool.protocol.checksum import checksum
from kvpool.client.tcp import TcpTransport
from kvpool.client.transport import WriteOptions
from kvpool.protocol.cluster_layout import NodeRecord, TierRecord
from kvpool.cluster.etcd_client import EtcdClient
from kvpool.net.netutil import free_port, wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from kvpool.protocol.wire import WriteFlag
from storenode_harness import member_credential, master_channel

CAPACITY = 1 << 20
PUT_TIMEOUT = 1.0


class EtcdOps:
    """Blocking access to etcd for the test, on a private event loop."""

    def __init__(self, endpoint: str):
        self._loop = asyncio.new_event_loop()
        host, port = cluster_layout.parse_hostport(endpoint)
        self.client = self._run(self._connect(host, port))

    async def _connect(self, host, port):
        client = EtcdClient(host, port, member_credential())
        await client.connect()
        return client

    def _run(self, coro):
        return self._loop.run_until_complete(coro)

    def register_node(self, node_id: str, instance: str = "i1", capacity: int = CAPACITY) -> int:
        """What a storage node does on start; returns the lease id."""
        record = NodeRecord(node_id=node_id, instance=instance, host="127.0.0.1", data_port=free_port(),
                            tiers={"dram": TierRecord(capacity=capacity)})

        async def register():
            lease = await self.client.lease(30)  # outlives the test; revoked explicitly
            await self.client.put(cluster_layout.node_key("default", node_id), record.to_json(), lease=lease)
            return lease.id

        return self._run(register())

    def revoke(self, lease_id: int) -> None:
        self._run(self.client.revoke_lease(lease_id))

    def get(self, key: bytes) -> bytes | None:
        result = self._run(self.client.get(key))
        return result.value if result is not None else None

    def close(self) -> None:
        self._run(self.client.close())
        self._loop.close()


class MasterProcess:
    def __init__(self, etcd_endpoint: str, log_path, *extra_args: str):
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpool.master", "--etcd", etcd_endpoint, "--put-timeout", str(PUT_TIMEOUT),
             "--master-id", "m-test", *extra_args],
            stdout=subprocess.PIPE, stderr=self.log, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=30)
        except queue.Empty:
            line = ""
        assert line.startswith("kvpool-master ready address="), f"no ready line (got {line!r}); see {log_path}"
        self.fields = dict(part.split("=", 1) for part in line.split()[2:])
        self.address = self.fields["address"]
        self.channel = master_channel(self.address)
        self.stub = kvpool_pb2_grpc.MasterStub(self.channel)

    def stop(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture
def etcd_ops(etcd):
    ops = EtcdOps(etcd)
    yield ops
    ops.close()


@pytest.fixture
def master(etcd, tmp_path):
    m = MasterProcess(etcd, tmp_path / "master.log")
    yield m
    m.stop()


@pytest.fixture
def node(master, etcd_ops):
    """One registered node, already known to the master; yields its lease id."""
    lease_id = etcd_ops.register_node("n1")
    wait_until(lambda: len(master.stub.Stats(pb.StatsRequest()).nodes) == 1, 10, what="node n1 in Stats")
    return lease_id


def put(stub, key, size=1000, overwrite=False):
    started = stub.PutStart(pb.PutStartRequest(key=key, size=size, checksum=42, overwrite=overwrite))
    assert started.status == pb.OK, started.message
    ended = stub.PutEnd(pb.PutEndRequest(key=key, generation=started.object.generation))
    assert ended.status == pb.OK, ended.message
    return started.object


def test_registered_node_and_master_record(master, etcd_ops):
    assert master.stub.Stats(pb.StatsRequest()).nodes == []
    etcd_ops.register_node("n1")
    stats = wait_until(lambda: (s := master.stub.Stats(pb.StatsRequest())).nodes and s, 10, what="node in Stats")
    assert stats.master_id == "m-test" and stats.address == master.address
    assert stats.control_address == master.fields["control"]
    (n1,) = stats.nodes
    assert n1.node_id == "n1" and list(n1.transports) == ["tcp"]
    assert [(t.tier, t.capacity, t.used) for t in n1.tiers] == [(pb.DRAM, CAPACITY, 0)]
    record = json.loads(etcd_ops.get(cluster_layout.master_key("default")))
    assert record == {"address": master.address, "master_id": "m-test", "control_address": stats.control_address}


def unsealed(placed: pb.ObjectInfo) -> pb.ObjectInfo:
    """A PutStart's answer as a reader is told it: where the copies are, without the seals to write them."""
    info = pb.ObjectInfo()
    info.CopyFrom(placed)
    for replica in info.replicas:
        replica.ClearField("seal")
    return info


def test_put_lifecycle_and_typed_errors(master, node):
    stub = master.stub
    started = stub.PutStart(pb.PutStartRequest(key="k", size=1000, checksum=42))
    assert started.status == pb.OK
    (replica,) = started.object.replicas
    assert replica.node_id == "n1" and replica.tier == pb.DRAM and replica.length == 1000
    assert len(replica.seal) == 16  # the leader's seal over the copy it placed (the cluster has a secret)
    assert stub.GetReplicaList(pb.GetReplicaListRequest(key="k")).status == pb.NOT_FOUND
    assert not stub.Exists(pb.ExistsRequest(key="k")).exists
    again = stub.PutStart(pb.PutStartRequest(key="k", size=10, overwrite=True))
    assert again.status == pb.EXISTS and "in progress" in again.message

    assert stub.PutEnd(pb.PutEndRequest(key="k", generation=started.object.generation)).status == pb.OK
    found = stub.GetReplicaList(pb.GetReplicaListRequest(key="k"))
    assert found.status == pb.OK and found.object == unsealed(started.object)
    assert stub.Exists(pb.ExistsRequest(key="k")).exists
    assert stub.PutStart(pb.PutStartRequest(key="k", size=10)).status == pb.EXISTS
    # Asked again (a client retrying after a lost answer or a failover), PutEnd finds it committed.
    again = stub.PutEnd(pb.PutEndRequest(key="k", generation=started.object.generation))
    assert again.status == pb.OK
    late = stub.PutEnd(pb.PutEndRequest(key="k", generation=started.object.generation - 1))
    assert late.status == pb.PUT_EXPIRED

    too_large = stub.PutStart(pb.PutStartRequest(key="big", size=CAPACITY + 1))
    assert too_large.status == pb.TOO_LARGE and str(CAPACITY) in too_large.message
    for bad in ("", "x" * 2000):
        reply = stub.PutStart(pb.PutStartRequest(key=bad, size=10))
        assert reply.status == pb.INVALID_KEY and reply.message
        assert stub.GetReplicaList(pb.GetReplicaListRequest(key=bad)).status == pb.INVALID_KEY
    assert stub.RemoveByPrefix(pb.RemoveByPrefixRequest(prefix="")).status == pb.INVALID_ARGUMENT

    # Overwrite: the new version replaces the old one.
    newer = put(stub, "k", size=2000, overwrite=True)
    assert newer.generation > started.object.generation
    stats = stub.Stats(pb.StatsRequest())
    assert stats.objects == 1 and stats.bytes == 2000 and stats.nodes[0].objects == 1

    assert stub.Remove(pb.RemoveRequest(key="k")) == pb.RemoveResponse(status=pb.OK, removed=1)
    assert stub.Remove(pb.RemoveRequest(key="k")).status == pb.NOT_FOUND
    assert stub.Stats(pb.StatsRequest()).nodes[0].objects == 0
    assert master.proc.poll() is None


def test_batch_rpcs_answer_per_item(master, node):
    stub = master.stub
    started = stub.BatchPutStart(pb.BatchPutStartRequest(keys=["b/1", "b/2"], sizes=[100, 0], checksums=[0, 0]))
    assert not started.refused and all(started.generations)

    ended = stub.BatchPutEnd(pb.BatchPutEndRequest(items=[
        pb.PutEndRequest(key="b/1", generation=started.generations[0]),
        pb.PutEndRequest(key="b/2", generation=started.generations[1]),
        pb.PutEndRequest(key="b/3", generation=1)]))
    assert [i.status for i in ended.items] == [pb.OK, pb.OK, pb.PUT_EXPIRED]

    got = stub.BatchGetReplicaList(pb.BatchGetReplicaListRequest(keys=["b/1", "b/2", "b/missing", ""]))
    assert [i.status for i in got.items] == [pb.OK, pb.OK, pb.NOT_FOUND, pb.INVALID_KEY]
    assert got.items[0].object.size == 100 and got.items[1].object.size == 0

    exists = stub.BatchExists(pb.BatchExistsRequest(keys=["b/1", "b/missing", "b/2"]))
    assert exists.status == pb.OK and list(exists.exists) == [True, False, True]
    assert stub.BatchExists(pb.BatchExistsRequest(keys=["b/1", ""])).status == pb.INVALID_KEY

    pending = stub.BatchPutStart(pb.BatchPutStartRequest(keys=["b/4"], sizes=[10], checksums=[0]))
    revoked = stub.BatchPutRevoke(pb.BatchPutRevokeRequest(items=[
        pb.PutRevokeRequest(key="b/4", generation=pending.generations[0]),
        pb.PutRevokeRequest(key="b/4", generation=pending.generations[0])]))
    assert [i.status for i in revoked.items] == [pb.OK, pb.PUT_EXPIRED]

    assert stub.RemoveByPrefix(pb.RemoveByPrefixRequest(prefix="b/")).removed == 2
    stats = stub.Stats(pb.StatsRequest())
    assert stats.objects == 0 and stats.pending_puts == 0 and stats.nodes[0].objects == 0
    assert stats.hits == 2 and stats.misses == 1


def test_columnar_batch_puts_answer_in_columns(master, node):
    stub = master.stub
    common = pb.PutStartRequest(replicas=1, options=pb.PutOptions(ttl_seconds=600))
    started = stub.BatchPutStart(pb.BatchPutStartRequest(
        common=common, keys=["c/0", "c/1", "", "c/2", "c/3"], sizes=[10, 100, 100, 0, CAPACITY * 2],
        checksums=[0, 1, 2, 3, 4]))
    generations = list(started.generations)
    assert generations[0] and generations[1] and generations[3] and generations[2] == generations[4] == 0
    assert len({generations[i] for i in (0, 1, 3)}) == 3
    assert list(started.refused) == [2, 4]
    assert [e.status for e in started.errors] == [pb.INVALID_KEY, pb.TOO_LARGE]
    placed = started.placements[started.placement[1]]  # where c/1 goes: the one node, this term
    assert [r.node_id for r in placed.replicas] == ["n1"] and placed.term > 0
    assert not started.placements[started.placement[3]].replicas  # an empty value needs no copy
    compressed = stub.BatchPutStart(pb.BatchPutStartRequest(
        common=common, keys=["c/4"], sizes=[10], checksums=[5], compressed=[True], raw_sizes=[40]))
    assert compressed.generations[0] and not compressed.refused
    uneven = stub.BatchPutStart(pb.BatchPutStartRequest(keys=["c/5", "c/6"], sizes=[1], checksums=[1, 2]))
    assert list(uneven.generations) == [0, 0] and list(uneven.refused) == [0, 1]
    assert [e.status for e in uneven.errors] == [pb.INVALID_ARGUMENT] * 2

    ended = stub.BatchPutEnd(pb.BatchPutEndRequest(
        items=[pb.PutEndRequest(key="c/0", generation=generations[0])], keys=["c/1", "c/2", "c/3", ""],
        generations=[generations[1], generations[3], 1, 1]))
    assert [i.status for i in ended.items] == [pb.OK, pb.OK, pb.OK, pb.PUT_EXPIRED, pb.INVALID_KEY]
    assert stub.BatchPutEnd(pb.BatchPutEndRequest(keys=["c/4"], generations=[])).items[0].status == \
        pb.INVALID_ARGUMENT
    exists = stub.BatchExists(pb.BatchExistsRequest(keys=["c/0", "c/1", "c/2", "c/3", "c/4"]))
    assert list(exists.exists) == [True, True, True, False, False]  # c/4 never ended: invisible
    stub.RemoveByPrefix(pb.RemoveByPrefixRequest(prefix="c/"))


def test_put_never_ended_is_reclaimed(master, node):
    stub = master.stub
    started = stub.PutStart(pb.PutStartRequest(key="stuck", size=4096))
    assert started.status == pb.OK
    assert stub.Stats(pb.StatsRequest()).pending_puts == 1

    def reclaimed():
        s = stub.Stats(pb.StatsRequest())
        return s.reclaimed_puts == 1 and s.pending_puts == 0

    wait_until(reclaimed, timeout=PUT_TIMEOUT + 5, what="the abandoned put to be reclaimed")
    late = stub.PutEnd(pb.PutEndRequest(key="stuck", generation=started.object.generation))
    assert late.status == pb.PUT_EXPIRED
    put(stub, "stuck")  # the key is free again


def test_node_lease_revoked_drops_node_and_objects(master, etcd_ops, node):
    stub = master.stub
    for i in range(5):
        put(stub, f"gone/{i}")
    assert stub.GetReplicaList(pb.GetReplicaListRequest(key="gone/0")).status == pb.OK
    etcd_ops.revoke(node)

    def all_gone():
        replies = stub.BatchGetReplicaList(pb.BatchGetReplicaListRequest(keys=[f"gone/{i}" for i in range(5)]))
        return all(r.status == pb.NOT_FOUND for r in replies.items)

    wait_until(all_gone, timeout=5, what="objects of the dropped node to disappear")
    stats = stub.Stats(pb.StatsRequest())
    assert stats.nodes == [] and stats.objects == 0
    reply = stub.PutStart(pb.PutStartRequest(key="after", size=10))
    assert reply.status == pb.NO_SPACE and reply.message == "no storage nodes"


def test_restarted_node_loses_its_objects(master, etcd_ops, node):
    stub = master.stub
    put(stub, "old")
    etcd_ops.register_node("n1", instance="i2")  # same node id, new process
    wait_until(lambda: stub.GetReplicaList(pb.GetReplicaListRequest(key="old")).status == pb.NOT_FOUND, 5,
               what="the restarted node's old object to disappear")
    (n1,) = stub.Stats(pb.StatsRequest()).nodes
    assert n1.objects == 0
    put(stub, "new")  # the new instance takes new puts


def test_sigterm_exits_cleanly_and_unregisters(master, etcd_ops):
    key = cluster_layout.master_key("default")
    assert etcd_ops.get(key) is not None
    assert master.stop() == 0
    assert etcd_ops.get(key) is None  # lease revoked on the way out, not left to expire


def test_max_object_size_option_and_metrics(etcd, etcd_ops, tmp_path):
    metrics_port = free_port()
    m = MasterProcess(etcd, tmp_path / "master.log", "--max-object-size", "4KiB",
                      "--metrics-port", str(metrics_port))
    try:
        etcd_ops.register_node("n1")
        wait_until(lambda: m.stub.Stats(pb.StatsRequest()).nodes, 10, what="node in Stats")
        assert m.stub.PutStart(pb.PutStartRequest(key="k", size=4097)).status == pb.TOO_LARGE
        put(m.stub, "k", size=4096)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as resp:
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                       for family in text_string_to_metric_families(resp.read().decode()) for s in family.samples}
        assert samples[("kvpool_master_objects", ())] == 1
        assert samples[("kvpool_master_tier_capacity_bytes", (("node", "n1"), ("tier", "dram")))] == CAPACITY
        # No REPORT comes from a node that is only a record: the put stays counted as sent since.
        assert samples[("kvpool_master_tier_reserved_bytes", (("node", "n1"), ("tier", "dram")))] == 4096
        assert samples[("kvpool_master_tier_used_bytes", (("node", "n1"), ("tier", "dram")))] == 4096
        assert samples[("kvpool_master_tier_objects", (("node", "n1"), ("tier", "dram")))] == 1
        assert samples[("kvpool_master_rpcs_total", (("method", "PutStart"),))] == 2
        assert samples[("kvpool_master_rpc_errors_total", (("method", "PutStart"), ("status", "TOO_LARGE")))] == 1
    finally:
        assert m.stop() == 0


def test_options_are_echoed_and_ttl_is_enforced_by_the_master(master, node):
    stub = master.stub
    options = pb.PutOptions(tier=pb.SSD, pin=pb.PIN_SOFT, pin_ttl_seconds=60, ttl_seconds=0.5)
    started = stub.PutStart(pb.PutStartRequest(key="t", size=300, checksum=5, options=options,
                                               compressed=True, raw_size=3000))
    assert started.status == pb.OK, started.message
    info = started.object
    assert info.options == options and info.compressed and info.raw_size == 3000 and info.size == 300
    assert [(r.tier, r.length, r.offset) for r in info.replicas] == [(pb.SSD, 300, 0)]
    assert stub.PutEnd(pb.PutEndRequest(key="t", generation=info.generation)).status == pb.OK
    plain = put(stub, "plain")
    assert not plain.HasField("options") and plain.raw_size == 1000 and not plain.compressed

    found = stub.GetReplicaList(pb.GetReplicaListRequest(key="t"))
    assert found.status == pb.OK and found.object == unsealed(info)
    # Past its ttl the master stops serving it and drops it, without any node telling it to.
    wait_until(lambda: stub.GetReplicaList(pb.GetReplicaListRequest(key="t")).status == pb.NOT_FOUND, 5,
               what="the object to expire at the master")
    assert not stub.Exists(pb.ExistsRequest(key="t")).exists
    stats = stub.Stats(pb.StatsRequest())
    assert stats.objects == 1 and stats.bytes == 1000
    assert stub.PutStart(pb.PutStartRequest(key="t", size=10)).status == pb.OK  # the key is free again

    bad = stub.PutStart(pb.PutStartRequest(key="bad", size=10, options=pb.PutOptions(ttl_seconds=-1)))
    assert bad.status == pb.INVALID_ARGUMENT and "ttl_seconds" in bad.message
    bad = stub.PutStart(pb.PutStartRequest(key="bad", size=10, raw_size=11))
    assert bad.status == pb.INVALID_ARGUMENT and "raw_size" in bad.message


def test_hold_arguments_are_checked(master, node):
    stub = master.stub
    put(stub, "h")
    assert stub.Exists(pb.ExistsRequest(key="h", hold_seconds=-1)).status == pb.INVALID_ARGUMENT
    assert stub.BatchExists(pb.BatchExistsRequest(keys=["h"], hold_seconds=float("nan"))).status \
        == pb.INVALID_ARGUMENT
    # The node is only a record here: a HOLD it cannot be sent leaves the answer to the table.
    reply = stub.BatchExists(pb.BatchExistsRequest(keys=["h", "nope"], hold_seconds=10))
    assert reply.status == pb.OK and list(reply.exists) == [True, False]
    assert master.proc.poll() is None


# ----- with real storage nodes -----

REPORT_INTERVAL = "0.1"
KiB, MiB = 1 << 10, 1 << 20


class DataPath:
    """Blocking writes and reads straight to storage nodes, as a client makes them (with the leader's seal), or
    as a member (a write no leader placed)."""

    def __init__(self):
        self._loop = asyncio.new_event_loop()
        self._transport = TcpTransport()
        self._member = TcpTransport(credential=member_credential())

    def write(self, address: str, key: str, generation: int, data: bytes, flags: int = 0, seal: bytes = b"",
              term: int = 0) -> None:
        self._loop.run_until_complete((self._transport if seal else self._member).write(
            address, key.encode(), generation, memoryview(data), checksum(data), WriteOptions(flags=flags, seal=seal)
            if seal else WriteOptions(flags=flags), term=term))

    def read(self, address: str, key: str, generation: int, size: int) -> bytes:
        buf = bytearray(size)
        digest = self._loop.run_until_complete(self._transport.read_into(address, key.encode(), generation,
                                                                         memoryview(buf)))
        assert digest == checksum(buf)
        return bytes(buf)

    def close(self) -> None:
        self._loop.run_until_complete(self._transport.close())
        self._loop.run_until_complete(self._member.close())
        self._loop.close()


@pytest.fixture
def data_path():
    path = DataPath()
    yield path
    path.close()


def stub_of(cluster):
    channel = master_channel(cluster.master_address)
    return kvpool_pb2_grpc.MasterStub(channel)


def store(stub, data_path, key, data, options=None, flags=0):
    """A whole put: PutStart, WRITE to every replica, PutEnd; returns the ObjectInfo."""
    started = stub.PutStart(pb.PutStartRequest(key=key, size=len(data), checksum=checksum(data), options=options))
    assert started.status == pb.OK, started.message
    for replica in started.object.replicas:
        data_path.write(replica.address, key, started.object.generation, data, flags, replica.seal,
                        started.object.term)
    assert stub.PutEnd(pb.PutEndRequest(key=key, generation=started.object.generation)).status == pb.OK
    return started.object


def status_of(stub, key):
    return stub.GetReplicaList(pb.GetReplicaListRequest(key=key)).status


def node_stats(stub, node_id):
    return next(n for n in stub.Stats(pb.StatsRequest()).nodes if n.node_id == node_id)


def dram_of(node):
    return next(t for t in node.tiers if t.tier == pb.DRAM)


def test_placement_follows_what_nodes_report(own_cluster, data_path):
    cluster = own_cluster(nodes=2, dram_per_node="16MiB", master_args=["--report-interval", REPORT_INTERVAL])
    stub = stub_of(cluster)
    node0 = cluster.nodes[0].info
    # Bytes the master never placed: only node-0's REPORT can tell it they are there.
    data_path.write(node0["address"], "unplaced", 12345, b"u" * (6 * MiB))
    # A REPORT taken while the WRITE was still arriving shows its extent but no object yet: wait for both.
    reported = wait_until(lambda: (d := dram_of(n := node_stats(stub, "node-0"))).used >= 6 * MiB
                          and d.objects == 1 and n, 10, what="node-0's report of the unplaced bytes")
    dram = dram_of(reported)
    assert dram.capacity == 16 * MiB and dram.watermark in ("low", "normal", "high")
    # With equal free space node-0 would win on its id; it has less, so node-1 takes the puts.
    for i in range(3):
        info = store(stub, data_path, f"p/{i}", b"p" * KiB)
        assert [r.node_id for r in info.replicas] == ["node-1"]
    assert node_stats(stub, "node-0").objects == 0 and node_stats(stub, "node-1").objects == 3


def test_objects_a_node_evicts_leave_the_master(own_cluster, data_path):
    cluster = own_cluster(nodes=1, dram_per_node="4MiB", master_args=["--report-interval", REPORT_INTERVAL])
    stub = stub_of(cluster)
    size = MiB - 4 * KiB
    infos = [store(stub, data_path, f"e/{i}", bytes([i]) * size) for i in range(8)]
    # Four fit at most: the node evicted the coldest, and its REPORTs tell the master which.

    def settled():
        statuses = [status_of(stub, f"e/{i}") for i in range(8)]
        stats = stub.Stats(pb.StatsRequest())
        live = statuses.count(pb.OK)
        agree = live <= 4 and stats.objects == stats.nodes[0].objects == dram_of(stats.nodes[0]).objects == live
        return agree and (statuses, stats.nodes[0])

    statuses, node = wait_until(settled, 10, what="the master to agree with the node on what is left")
    assert statuses[0] == pb.NOT_FOUND and statuses[-1] == pb.OK, statuses
    assert dram_of(node).evictions == statuses.count(pb.NOT_FOUND)
    assert data_path.read(infos[-1].replicas[0].address, "e/7", infos[-1].generation, size) == bytes([7]) * size


def test_hold_is_sent_only_when_asked(own_cluster, data_path):
    cluster = own_cluster(nodes=1, dram_per_node="4MiB", master_args=["--report-interval", REPORT_INTERVAL])
    stub = stub_of(cluster)
    size = MiB - 4 * KiB
    infos = {key: store(stub, data_path, key, key.encode() * size) for key in ("a", "b", "c")}
    # "a" is the coldest, so the first victim, unless the node holds it.
    assert stub.Exists(pb.ExistsRequest(key="a", hold_seconds=60)).exists
    assert stub.Exists(pb.ExistsRequest(key="b")).exists
    assert list(stub.BatchExists(pb.BatchExistsRequest(keys=["c"])).exists) == [True]
    for key in ("d", "e"):
        store(stub, data_path, key, key.encode() * size)
    wait_until(lambda: status_of(stub, "b") == pb.NOT_FOUND, 10, what="b to be evicted and reported")
    assert status_of(stub, "a") == pb.OK
    assert data_path.read(infos["a"].replicas[0].address, "a", infos["a"].generation, size) == b"a" * size

    # A committed object its node does not hold (never written): only a hold asks the node, and
    # the node's "not held" answer drops it.
    started = stub.PutStart(pb.PutStartRequest(key="ghost", size=10, checksum=1))
    assert stub.PutEnd(pb.PutEndRequest(key="ghost", generation=started.object.generation)).status == pb.OK
    assert stub.Exists(pb.ExistsRequest(key="ghost")).exists
    assert not stub.Exists(pb.ExistsRequest(key="ghost", hold_seconds=5)).exists
    assert status_of(stub, "ghost") == pb.NOT_FOUND


def test_restarted_node_and_master_take_back_what_the_node_kept(own_cluster, data_path, tmp_path):
    cluster = own_cluster(nodes=1, dram_per_node="8MiB", ssd_per_node="16MiB",
                          master_args=["--report-interval", REPORT_INTERVAL])
    stub = stub_of(cluster)
    ssd = pb.PutOptions(tier=pb.SSD)
    kept = store(stub, data_path, "kept", b"k" * 100_000, options=ssd, flags=WriteFlag.PREFER_SSD)
    store(stub, data_path, "in-dram", b"d" * 1000)
    # Written behind the master's back: unknown to it, so adopted as the node describes it.
    data_path.write(cluster.nodes[0].info["address"], "stranger", 777, b"s" * 5000, WriteFlag.PREFER_SSD)

    cluster.nodes[0].kill()
    node = cluster.restart_node(0)
    wait_until(lambda: status_of(stub, "kept") == pb.OK and status_of(stub, "stranger") == pb.OK, 15,
               what="the SSD objects to be taken back from the restarted node")
    again = stub.GetReplicaList(pb.GetReplicaListRequest(key="kept")).object
    assert again.generation == kept.generation and again.options == ssd
    assert [(r.address, r.tier) for r in again.replicas] == [(node.info["address"], pb.SSD)]
    assert data_path.read(node.info["address"], "kept", kept.generation, 100_000) == b"k" * 100_000
    stranger = stub.GetReplicaList(pb.GetReplicaListRequest(key="stranger")).object
    assert (stranger.generation, stranger.size, stranger.checksum) == (777, 5000, checksum(b"s" * 5000))
    assert status_of(stub, "in-dram") == pb.NOT_FOUND  # DRAM does not survive a restart

    # A new master knows nothing until the node's inventory tells it; it asks before serving.
    cluster.master.stop()
    fresh = MasterProcess(cluster.etcd_endpoint, tmp_path / "master2.log")
    try:
        found = fresh.stub.GetReplicaList(pb.GetReplicaListRequest(key="kept"))
        assert found.status == pb.OK and found.object.generation == kept.generation
        assert fresh.stub.Stats(pb.StatsRequest()).objects == 2
        assert fresh.stub.PutStart(pb.PutStartRequest(key="new", size=10)).object.generation > kept.generation
    finally:
        assert fresh.stop() == 0
