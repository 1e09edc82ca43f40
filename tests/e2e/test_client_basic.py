"""Client and AsyncClient against a real cluster: etcd, one master, two storage nodes."""

import asyncio
import queue
import signal
import string
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kvpool import AsyncClient, Client
from kvpool.net.tcp_link import TcpLink
from kvpool.security.auth import client_credential
from kvpool.errors import (
    BatchError, Code, InvalidArgumentError, InvalidKeyError, KeyExistsError, KeyNotFoundError,
    UnavailableError,
)
from kvpool.net.netutil import free_port, wait_until
from kvpool.proto import kvpool_pb2, kvpool_pb2_grpc
from kvpool.protocol.wire import WriteFlag
from storenode_harness import (FAIL_FAST, PATIENT, PATIENT_TIMEOUTS, inventory_at, master_channel, member_credential,
                               ping)

pytestmark = pytest.mark.quick  # among the fastest end-to-end tests (tests/tiers.py)

# Repeating runs of 32-bit token ids: compresses well, like a shared prompt prefix.
TOKENS = np.tile(np.arange(30_000, 30_256, dtype=np.uint32), 1024).tobytes()  # 1 MiB


class Process:
    """A kvpool component started as `python -m <module> ...`; waits for its ready line."""

    def __init__(self, module: str, args: list, log_path, ready_prefix: str, timeout: float = 30):
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                         stderr=log, text=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: lines.put(self.proc.stdout.readline()), daemon=True).start()
        try:
            line = lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line.startswith(ready_prefix):
            self.stop()
            raise RuntimeError(f"{module}: no ready line (got {line!r}); log: {open(log_path).read()}")
        self.fields = dict(field.split("=", 1) for field in line.split()[2:])

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


class Cluster:
    def __init__(self, etcd: str, tmp_path):
        self.etcd = etcd
        self.master = Process("kvpool.master", ["--etcd", etcd, "--port", "0", "--put-timeout", "5"],
                              tmp_path / "master.log", "kvpool-master ready ")
        self.address = self.master.fields["address"]
        self.nodes = [
            Process("kvpool.storenode", ["--etcd", etcd, "--dram", "32MiB", "--port", "0", "--node-id", f"n{i}"],
                    tmp_path / f"n{i}.log", "kvpool-storenode ready ")
            for i in (1, 2)]
        with Client(self.address) as client:
            wait_until(lambda: len(client.stats().nodes) == 2, 15, what="both nodes known to the master")

    def node(self, node_id: str) -> Process:
        return next(n for n in self.nodes if n.fields["node_id"] == node_id)

    def stop(self) -> None:
        for process in (*self.nodes, self.master):
            process.stop()


@pytest.fixture(scope="module")
def shared_cluster(module_etcd, tmp_path_factory):
    started = Cluster(module_etcd, tmp_path_factory.mktemp("shared"))
    yield started
    started.stop()


@pytest.fixture
def cluster(shared_cluster):
    """The module's cluster, empty: what a test stores is removed after it (stopping or restarting a
    process of it is for `own`)."""
    yield shared_cluster
    with Client(shared_cluster.address) as client:
        for first in string.ascii_letters + string.digits + string.punctuation:  # "" is refused: every key
            client.remove_prefix(first)
        assert client.stats().objects == 0


@pytest.fixture
def own(etcd, tmp_path):
    """A cluster for one test that kills or restarts a part of it."""
    started = Cluster(etcd, tmp_path)
    yield started
    started.stop()


def master_object(cluster, key: str):
    """The master's ObjectInfo for key, asked directly over gRPC."""
    with master_channel(cluster.address) as channel:
        reply = kvpool_pb2_grpc.MasterStub(channel).GetReplicaList(kvpool_pb2.GetReplicaListRequest(key=key))
    assert reply.status == kvpool_pb2.OK, reply.message
    return reply.object


def missing(client, key) -> bool:
    try:
        client.get(key)
    except KeyNotFoundError:
        return True
    return False


def test_sync_client_round_trips(cluster):
    rng = np.random.default_rng(7)
    big = rng.integers(0, 256, 3 * 1024 * 1024 + 17, dtype=np.uint8)  # more than a socket buffer
    with Client(etcd=cluster.etcd) as client:
        client.put("bytes", b"hello kvpool")
        client.put("bytearray", bytearray(b"\x00\x01\x02"))
        client.put("slice", memoryview(b"0123456789")[3:7])
        client.put("numpy", big)
        client.put("empty", b"")
        assert client.get("bytes") == b"hello kvpool"
        assert client.get("bytearray") == b"\x00\x01\x02"
        assert client.get("slice") == b"3456"
        assert client.get("numpy") == big.tobytes()
        assert client.get("empty") == b""

        dest = np.zeros(big.size + 100, dtype=np.uint8)
        assert client.get_into("numpy", dest) == big.size
        assert np.array_equal(dest[:big.size], big) and not dest[big.size:].any()
        with pytest.raises(InvalidArgumentError, match="too small"):
            client.get_into("numpy", bytearray(10))
        with pytest.raises(InvalidArgumentError, match="read-only"):
            client.get_into("bytes", b" " * 64)

        with pytest.raises(KeyExistsError):
            client.put("bytes", b"other")
        client.put("bytes", b"replaced", overwrite=True)
        assert client.get("bytes") == b"replaced"

        with pytest.raises(KeyNotFoundError):
            client.get("no-such-key")
        with pytest.raises(InvalidKeyError):
            client.put("", b"x")
        with pytest.raises(InvalidArgumentError, match="contiguous"):
            client.put("strided", big[::2])

        assert client.exists("numpy") and not client.exists("no-such-key")
        assert client.batch_exists(["bytes", "nope", "empty"]) == [True, False, True]
        assert client.remove("bytearray") is True
        assert client.remove("bytearray") is False
        assert missing(client, "bytearray")
        assert client.stats().objects == 4


def test_sync_client_batches(cluster):
    keys = [f"layer/{i}" for i in range(40)]
    values = [bytes([i]) * (1000 + 97 * i) for i in range(40)]
    with Client(cluster.address) as client:
        client.batch_put(keys, values)
        assert client.batch_get([*keys, "layer/missing"]) == [*values, None]
        buffers = [bytearray(8000) for _ in keys]
        sizes = client.batch_get_into(keys, buffers)
        assert sizes == [len(v) for v in values]
        assert all(buf[:size] == value for buf, size, value in zip(buffers, sizes, values))
        assert client.batch_get_into(["layer/missing"], [bytearray(1)]) == [None]

        # Two keys already exist: the others are stored, the error names exactly those two.
        with pytest.raises(BatchError) as caught:
            client.batch_put(["fresh/1", "layer/3", "fresh/2", "layer/5"], [b"a", b"b", b"c", b"d"])
        assert set(caught.value.errors) == {"layer/3", "layer/5"} and caught.value.code == Code.EXISTS
        assert client.batch_get(["fresh/1", "fresh/2", "layer/3"]) == [b"a", b"c", values[3]]

        assert client.remove_prefix("layer/") == 40
        assert client.batch_get(keys[:3]) == [None, None, None]
        assert client.batch_exists(["fresh/1", "layer/0"]) == [True, False]


def test_async_client(cluster):
    async def scenario():
        async with AsyncClient(cluster.address) as client:
            await client.put("a", b"alpha")
            assert await client.get("a") == b"alpha"
            # Many concurrent requests share the pipelined connections.
            values = {f"k{i}": np.full(5000 + i, i % 256, dtype=np.uint8) for i in range(60)}
            await asyncio.gather(*(client.put(k, v) for k, v in values.items()))
            got = await asyncio.gather(*(client.get(k) for k in values))
            assert got == [v.tobytes() for v in values.values()]
            buf = bytearray(6000)
            assert await client.get_into("k3", buf) == 5003 and buf[:5003] == values["k3"].tobytes()
            await client.batch_put(["b1", "b2"], [b"one", b"two"])
            assert await client.batch_get(["b2", "zz", "b1"]) == [b"two", None, b"one"]
            assert await client.batch_get_into(["b1"], [bytearray(3)]) == [3]
            assert await client.exists("b1") and await client.batch_exists(["b1", "zz"]) == [True, False]
            assert await client.remove("b1") and await client.remove_prefix("k") == 60
            with pytest.raises(KeyNotFoundError):
                await client.get("b1")
            assert (await client.stats()).objects == 2

    asyncio.run(scenario())


def test_cached_placement_skips_the_master(cluster):
    with Client(cluster.address) as writer, Client(cluster.address) as reader:
        writer.put("hot", b"block")
        lookups = writer.stats().hits
        assert writer.get("hot") == b"block"  # placement remembered from the put
        assert writer.stats().hits == lookups
        assert reader.get("hot") == b"block"  # a fresh client asks once...
        assert reader.get("hot") == b"block"  # ...then reads straight from the node
        assert reader.stats().hits == lookups + 1


def test_stale_cached_placement_is_refreshed(cluster):
    with Client(cluster.address) as a, Client(cluster.address) as b:
        a.put("moving", b"first")
        assert a.get("moving") == b"first"
        b.put("moving", b"second version", overwrite=True)
        # The master frees the old extent in the background; once it has, a's cached read
        # comes back STALE and a must find the new version through the master on its own.
        wait_until(lambda: a.get("moving") == b"second version", 10, what="a to see the overwrite")
        b.remove("moving")
        wait_until(lambda: missing(a, "moving"), 10, what="a to see the removal")


def test_dead_node_fails_fast_and_replicas_cover_it(own):
    # Every timeout long: reads that waited one out would take PATIENT s, far above the FAIL_FAST bound.
    with Client(own.address, **PATIENT_TIMEOUTS) as single, Client(own.address, replicas=2) as double:
        keys = [f"s{i}" for i in range(8)]
        single.batch_put(keys, [k.encode() for k in keys])
        double.put("both", b"two copies")
        victim = own.nodes[0]
        victim.stop(signal.SIGKILL)

        assert double.get("both") == b"two copies"  # the surviving replica answers
        began = time.monotonic()
        outcomes = []
        for key in keys:
            try:
                outcomes.append(single.get(key) == key.encode())
            except UnavailableError:
                outcomes.append("unavailable")
        assert time.monotonic() - began < FAIL_FAST, "a dead node must fail fast, not time out"
        assert "unavailable" in outcomes and True in outcomes and False not in outcomes
        with pytest.raises(BatchError) as caught:
            single.batch_get(keys)
        assert caught.value.code == Code.UNAVAILABLE
        assert len(caught.value.errors) == outcomes.count("unavailable")


def test_tcp_link_ping_and_refused(cluster):
    async def scenario():
        transport = TcpLink(connect_timeout=PATIENT, credential=member_credential())
        try:
            node = cluster.nodes[1].fields
            pings = await asyncio.gather(*(ping(transport, node["address"]) for _ in range(20)))
            assert pings == [node["node_id"]] * 20
            began = time.monotonic()
            with pytest.raises(UnavailableError):
                await ping(transport, f"127.0.0.1:{free_port()}")
            assert time.monotonic() - began < FAIL_FAST  # refused at once, not after the connect timeout
            assert not await transport.free(node["address"], b"never-stored", 1)
            assert not await transport.hold(node["address"], b"never-stored", 1, 1000)
            report = await transport.report(node["address"])
            assert report["node_id"] == node["node_id"] and report["tiers"]["dram"]["capacity"] == 32 << 20
            assert all(e.generation > 0 and e.key for e in await transport.inventory(node["address"]))
        finally:
            await transport.close()
        with pytest.raises(UnavailableError):
            await ping(transport, node["address"])

    asyncio.run(scenario())


def test_node_connections_fail_every_pending_request_when_the_node_dies(own):
    victim = own.nodes[0]

    async def scenario():
        transport = TcpLink(credential=client_credential())  # PING: served to any peer
        try:
            address = victim.fields["address"]
            await ping(transport, address)  # connected
            victim.proc.send_signal(signal.SIGSTOP)  # requests now queue up unanswered
            pings = [asyncio.ensure_future(ping(transport, address)) for _ in range(50)]
            connection = transport._connections[address]
            deadline = time.monotonic() + 10
            while len(connection._pending) < len(pings):  # every frame is on the wire
                assert time.monotonic() < deadline, "pings were not sent"
                await asyncio.sleep(0.01)
            victim.proc.kill()
            results = await asyncio.wait_for(asyncio.gather(*pings, return_exceptions=True), 10)
            assert all(isinstance(r, UnavailableError) for r in results), results
            victim.proc.wait(10)  # its listening socket is gone only once it has exited
            with pytest.raises(UnavailableError, match="cannot connect"):
                await ping(transport, address)  # the dead connection was dropped; reconnecting fails fast
        finally:
            await transport.close()

    asyncio.run(scenario())


def test_etcd_client_follows_a_restarted_master(own, tmp_path):
    with Client(etcd=own.etcd) as client:
        client.put("before", b"1")
        old_address = own.address
        own.master.stop()
        with Client(old_address) as pinned, pytest.raises(UnavailableError):
            pinned.exists("before")  # a client pinned to the old address fails, typed
        port = free_port()
        while f"127.0.0.1:{port}" == old_address:
            port = free_port()
        own.master = Process("kvpool.master", ["--etcd", own.etcd, "--port", str(port)],
                             tmp_path / "master2.log", "kvpool-master ready ")
        # The client finds the new master through etcd by itself.
        assert client.stats().address == f"127.0.0.1:{port}"
        wait_until(lambda: len(client.stats().nodes) == 2, 15, what="nodes known to the new master")
        client.put("after", b"2")
        assert client.get("after") == b"2"


def test_master_lookup_failures_are_typed(module_etcd):
    etcd = module_etcd
    with pytest.raises(InvalidArgumentError):
        Client()
    with pytest.raises(InvalidArgumentError):
        Client("127.0.0.1:1", etcd=etcd)
    with Client(etcd=etcd, cluster="no-such-cluster") as client, \
            pytest.raises(UnavailableError, match="no master registered"):
        client.exists("x")
    with Client(f"127.0.0.1:{free_port()}", **PATIENT_TIMEOUTS) as client:
        began = time.monotonic()
        with pytest.raises(UnavailableError):
            client.get("x")
        assert time.monotonic() - began < FAIL_FAST  # nobody listens: refused at once, not after the rpc timeout


def test_compressed_values_round_trip_through_every_get(cluster):
    plain = bytes(range(256)) * 40
    with Client(cluster.address) as client:
        client.put("lz4/tokens", TOKENS, compress=True)
        info = master_object(cluster, "lz4/tokens")
        assert info.compressed and info.raw_size == len(TOKENS) and info.size * 10 < len(TOKENS)
        entry = inventory_at(info.replicas[0].address)["lz4/tokens"]
        assert entry["flags"] & WriteFlag.COMPRESSED and entry["raw_size"] == len(TOKENS)
        assert entry["size"] == info.size  # the node holds the compressed bytes

        assert client.get("lz4/tokens") == TOKENS
        assert client.size("lz4/tokens") == len(TOKENS)  # the value's size, not the stored bytes
        dest = np.zeros(len(TOKENS) + 64, dtype=np.uint8)
        assert client.get_into("lz4/tokens", dest) == len(TOKENS)
        assert dest[:len(TOKENS)].tobytes() == TOKENS and not dest[len(TOKENS):].any()
        with pytest.raises(InvalidArgumentError, match="too small"):
            client.get_into("lz4/tokens", bytearray(info.size))  # room for the stored bytes, not the value

        keys = [f"lz4/batch/{i}" for i in range(6)]
        values = [TOKENS[i * 1000:] for i in range(6)]
        client.batch_put(keys, values, compress=True)
        client.put("lz4/plain", plain)
        assert client.batch_get([*keys, "lz4/plain", "lz4/none"]) == [*values, plain, None]
        buffers = [bytearray(len(TOKENS)) for _ in keys]
        assert client.batch_get_into(keys, buffers) == [len(v) for v in values]
        assert all(buf[:len(v)] == v for buf, v in zip(buffers, values))
        with pytest.raises(BatchError) as caught:
            client.batch_get_into(keys[:2], [bytearray(len(values[0])), bytearray(10)])
        assert set(caught.value.errors) == {keys[1]} and caught.value.code == Code.INVALID_ARGUMENT
        # What did arrive is told too: the first value was read whole.
        assert caught.value.results[0] == len(values[0]) and caught.value.results[1] is caught.value.errors[keys[1]]
    with Client(cluster.address) as fresh:  # no cached placement: the master's metadata says compressed
        assert fresh.get("lz4/tokens") == TOKENS
        with Client(cluster.address) as other:
            client_size_of_removed(fresh, other)
        assert fresh.batch_get(keys[:2]) == values[:2]
        fresh.remove_prefix("lz4/")


def test_compress_above_policy(cluster):
    incompressible = np.random.default_rng(3).integers(0, 256, 200_000, dtype=np.uint8).tobytes()

    async def scenario():
        async with AsyncClient(cluster.address, compress_above=64 * 1024) as client:
            await client.put("policy/big", TOKENS)
            await client.put("policy/small", TOKENS[:4096])
            await client.put("policy/random", incompressible)
            await client.put("policy/opt-out", TOKENS, compress=False)
            await client.batch_put(["policy/b1", "policy/b2"], [TOKENS, TOKENS[:100]])
            assert await client.batch_get(["policy/big", "policy/small", "policy/random", "policy/b1"]) == \
                [TOKENS, TOKENS[:4096], incompressible, TOKENS]

    asyncio.run(scenario())
    compressed = {key: master_object(cluster, key).compressed for key in
                  ("policy/big", "policy/small", "policy/random", "policy/opt-out", "policy/b1", "policy/b2")}
    assert compressed == {"policy/big": True, "policy/small": False, "policy/random": False,
                          "policy/opt-out": False, "policy/b1": True, "policy/b2": False}
    with Client(cluster.address) as client:
        assert client.remove_prefix("policy/") == 6


def test_put_options_reach_the_master_and_the_node(cluster):
    with Client(cluster.address) as client:
        client.put("opt/soft", b"soft", pin="soft", ttl=600)
        client.put("opt/hard", b"hard", pin="hard", tier="dram")
        client.batch_put(["opt/b1", "opt/b2"], [b"1", b"2"], pin="soft", pin_ttl=30)
        soft = master_object(cluster, "opt/soft")
        assert soft.options.pin == kvpool_pb2.PIN_SOFT and soft.options.pin_ttl_seconds == 600
        assert soft.options.ttl_seconds == 600
        assert master_object(cluster, "opt/hard").options.pin == kvpool_pb2.PIN_HARD
        assert master_object(cluster, "opt/b2").options.pin_ttl_seconds == 30

        inventory = {}
        for node in cluster.nodes:
            inventory.update(inventory_at(node.fields["address"]))
        assert 0 < inventory["opt/soft"]["ttl_ms"] <= 600_000
        assert inventory["opt/hard"]["flags"] & WriteFlag.HARD_PIN and inventory["opt/hard"]["ttl_ms"] == 0
        assert not inventory["opt/b1"]["flags"] & WriteFlag.HARD_PIN
        assert client.batch_get(["opt/soft", "opt/hard", "opt/b1"]) == [b"soft", b"hard", b"1"]

        for bad in ({"tier": "tape"}, {"pin": "forever"}, {"ttl": -5}, {"pin_ttl": 10}, {"compress": 1}):
            with pytest.raises(InvalidArgumentError):
                client.put("opt/bad", b"x", **bad)
        assert not client.exists("opt/bad")  # refused before anything was started

        assert client.exists("opt/soft", hold=5) is True
        assert client.batch_exists(["opt/hard", "opt/none"], hold=2.5) == [True, False]
        assert client.exists("opt/none", hold=1) is False
        with pytest.raises(InvalidArgumentError, match="hold"):
            client.exists("opt/soft", hold=-1)
        assert client.remove_prefix("opt/") == 4


def test_object_its_node_no_longer_holds_is_not_found(cluster):
    """What a get sees when a node evicted an object before the master heard of it."""
    with Client(cluster.address) as writer:
        writer.batch_put(["gone/a", "gone/b", "gone/c", "kept"], [b"a", b"b", b"c" * 5000, b"k"],
                         compress=False)
        writer.put("gone/z", TOKENS, compress=True)

        async def drop(keys):
            transport = TcpLink(connect_timeout=PATIENT, credential=member_credential())
            try:
                for key in keys:
                    info = master_object(cluster, key)
                    assert await transport.free(info.replicas[0].address, key.encode(), info.generation)
            finally:
                await transport.close()

        asyncio.run(drop(["gone/a", "gone/b", "gone/c", "gone/z"]))
        with Client(cluster.address) as reader:  # placements fresh from the master
            with pytest.raises(KeyNotFoundError):
                reader.get("gone/a")
            with pytest.raises(KeyNotFoundError):
                reader.get_into("gone/z", bytearray(len(TOKENS)))
            assert reader.batch_get(["gone/b", "kept", "gone/z"]) == [None, b"k", None]
            assert reader.batch_get_into(["gone/c", "kept"], [bytearray(5000), bytearray(1)]) == [None, 1]
        with pytest.raises(KeyNotFoundError):
            writer.get("gone/b")  # cached placement: refetched once, then not found
        assert writer.get("kept") == b"k"
        writer.remove_prefix("gone/")
        writer.remove("kept")


def test_puts_of_new_keys_end_posted_and_are_seen_by_every_later_call(cluster):
    """A put of a new key returns before the master answers its PutEnd; what the writer does next,
    and what another client asks after the put returned, still finds it."""
    with Client(cluster.address) as writer, Client(cluster.address) as other:
        for i in range(50):
            writer.put(f"posted/{i}", bytes([i]) * 3000)
            assert writer.exists(f"posted/{i}")
            assert other.get(f"posted/{i}") == bytes([i]) * 3000
        writer.batch_put([f"posted/b{i}" for i in range(20)], [b"v%d" % i for i in range(20)])
        assert other.batch_exists([f"posted/b{i}" for i in range(20)]) == [True] * 20
        for i in range(20):  # the master may fold a batch's ends after answering them: never visibly
            writer.batch_put([f"posted/c{i}", f"posted/d{i}"], [b"c%d" % i, b"d%d" % i])
            assert other.batch_get([f"posted/c{i}", f"posted/d{i}"]) == [b"c%d" % i, b"d%d" % i]
            other.remove(f"posted/d{i}")
        assert writer.stats().objects >= 90  # a gRPC-routed call does not overtake the posted ends
        writer.flush()  # every end was answered OK: nothing to raise
        assert writer.remove_prefix("posted/") == 90


def test_a_posted_put_end_that_fails_is_raised_by_flush(own_cluster):
    from kvpool.errors import PutExpiredError

    # Every put outlives this timeout before its PutEnd arrives, so every PutEnd fails.
    cluster = own_cluster(nodes=1, put_timeout=0.0001)
    with Client(cluster.master_address) as client:
        client.put("late/one", b"x" * 1000)  # returns: its end was posted
        client.batch_put(["late/two", "late/three"], [b"y" * 1000, b"z" * 1000])
        with pytest.raises(BatchError) as caught:
            client.flush()
        assert set(caught.value.errors) == {"late/one", "late/two", "late/three"}
        assert all(isinstance(e, PutExpiredError) for e in caught.value.errors.values())
        assert client.batch_exists(["late/one", "late/two", "late/three"]) == [False] * 3
        with pytest.raises(KeyNotFoundError):  # its cached placement was dropped with the failure
            client.get("late/one")
        client.flush()  # each failure is raised once
    with Client(cluster.master_address, confirm_puts=True) as client, pytest.raises(PutExpiredError):
        client.put("late/four", b"x" * 1000)


def test_batch_put_of_keys_that_all_exist_names_each(cluster):
    with Client(cluster.address) as client:
        client.batch_put(["every/1", "every/2"], [b"a" * 100, b"b" * 100])
        with pytest.raises(BatchError) as caught:  # none is started: the master's answer has no placement
            client.batch_put(["every/1", "every/2"], [b"c" * 100, b"d" * 100])
        assert set(caught.value.errors) == {"every/1", "every/2"}
        assert all(isinstance(e, KeyExistsError) for e in caught.value.errors.values())
        with pytest.raises(BatchError) as caught:  # some new, some not: the new ones are stored
            client.batch_put(["every/2", "every/3"], [b"e" * 100, b"f" * 100])
        assert list(caught.value.errors) == ["every/2"]
        assert client.batch_get(["every/1", "every/2", "every/3"]) == [b"a" * 100, b"b" * 100, b"f" * 100]
        assert client.remove_prefix("every/") == 3


def test_a_batch_past_the_masters_limit_is_refused_whole_and_typed(own_cluster):
    cluster = own_cluster(nodes=1, master_args=["--max-batch", "10"])
    with Client(cluster.master_address) as client:
        client.batch_put([f"cap/{i}" for i in range(10)], [b"v"] * 10)  # at the limit: served
        with pytest.raises(InvalidArgumentError, match="max-batch"):
            client.batch_put([f"cap/x{i}" for i in range(11)], [b"v"] * 11)
        with pytest.raises(InvalidArgumentError, match="max-batch"):
            client.batch_exists([f"cap/{i}" for i in range(11)])
        assert client.batch_exists([f"cap/{i}" for i in range(10)]) == [True] * 10
        assert not client.exists("cap/x0")  # nothing of the refused batch was started
        assert client.stats().pending_puts == 0


def client_size_of_removed(client, other) -> None:
    """size asks the master, never the cache: a key another client removed since this one read it has no size."""
    client.put("lz4/size", b"12345")
    assert client.get("lz4/size") == b"12345" and client.size("lz4/size") == 5  # its placement cached now
    other.remove("lz4/size")
    with pytest.raises(KeyNotFoundError):
        client.size("lz4/size")
