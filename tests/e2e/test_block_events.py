"""The block-event stream a KV-aware router follows, served by the leading master (WatchKeys): snapshot pages,
resuming from a position or from a fresh snapshot, and a subscriber following the leader across a failover."""

import asyncio
import socket
import threading

import grpc
import pytest
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc

from kvpool import Client
from kvpool.connectors import REMOVED, STORED, BlockNamespace, block_events, block_hashes
from kvpool.launch.local_cluster import LocalCluster
from kvpool.master.serving.key_watch import PAGE_KEYS
from kvpool.net.netutil import wait_until
from storenode_harness import master_channel

FEED_SIZE = 8
NAMESPACE = BlockNamespace("events-test", "bfloat16", "vllm-nhd", 16)


def blocks(count: int, salt: int = 0) -> list[str]:
    return block_hashes([salt] + list(range(count * 16 - 1)), 16)


def store(client: Client, hashes: list[str]) -> None:
    client.batch_put([NAMESPACE.key(h) for h in hashes], [h.encode() for h in hashes])


@pytest.fixture(scope="module")
def small_feed(tmp_path_factory):
    """One master keeping only FEED_SIZE changes, so a subscriber falls behind it easily."""
    with LocalCluster(nodes=1, dram_per_node="64MiB", data_dir=tmp_path_factory.mktemp("feed"), lease_ttl=2,
                      master_args=["--key-feed-size", str(FEED_SIZE)]) as running:
        yield running


class Subscriber:
    """block_events run in a thread of its own, applied to an index as a router would."""

    def __init__(self, namespace: BlockNamespace, *args, **kwargs):
        self.events: list[tuple[str, str]] = []
        self.index: set[str] = set()
        self.drift: list[tuple[str, str]] = []  # events that did not change the index: there must be none
        self._loop = asyncio.new_event_loop()
        self._task = None
        self._thread = threading.Thread(target=self._run, args=(namespace, args, kwargs), daemon=True)
        self._thread.start()

    def _run(self, namespace, args, kwargs):
        async def follow():
            async for kind, block in block_events(namespace, *args, retry_delay=0.1, **kwargs):
                self.events.append((kind, block))
                if (kind == STORED) == (block in self.index):
                    self.drift.append((kind, block))
                (self.index.add if kind == STORED else self.index.discard)(block)

        self._task = self._loop.create_task(follow())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass

    def wait_for(self, expected: set[str], timeout: float = 30.0) -> None:
        wait_until(lambda: self.index == expected, timeout,
                   what=f"the subscriber's index to hold the {len(expected)} expected blocks")

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(10)
        assert not self._thread.is_alive()


class Proxy:
    """A TCP forwarder to `target` that the test can cut: open connections are closed and new ones
    closed at once until it is restored (a network break between the subscriber and the master)."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cut = threading.Event()
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            if self._cut.is_set():
                conn.close()
                continue
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._open += [conn, upstream]
            threading.Thread(target=self._pump, args=(conn, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, conn), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        self._cut.set()
        with self._lock:
            conns, self._open = self._open, []
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()

    def restore(self):
        self._cut.clear()

    def close(self):
        self.cut()
        self._listener.close()


def watch(address: str, prefix: str, feed_id: str = "", after: int = 0):
    """A raw WatchKeys stream (and its channel, to close)."""
    channel = master_channel(address)
    stream = kvpool_pb2_grpc.MasterStub(channel).WatchKeys(
        pb.WatchKeysRequest(prefix=prefix, feed_id=feed_id, after_sequence=after), timeout=30)
    return channel, stream


def read_snapshot(stream) -> tuple[list[pb.KeyEvents], set[str]]:
    pages = []
    for message in stream:
        assert message.snapshot
        pages.append(message)
        if message.snapshot_done:
            return pages, {key for page in pages for key in page.present}
    raise AssertionError("the stream ended inside a snapshot")


def test_resume_within_the_log_continues_and_out_of_it_gets_a_snapshot(small_feed):
    prefix = "watch-raw/"
    with Client(small_feed.master_address) as client:
        keys = [f"{prefix}{i:05d}" for i in range(PAGE_KEYS + 10)]
        client.batch_put(keys, [b"x"] * len(keys))
        channel, stream = watch(small_feed.master_address, prefix)
        pages, present = read_snapshot(stream)
        assert len(pages) == 2 and len(pages[0].present) == PAGE_KEYS  # a big snapshot comes in pages
        assert present == set(keys) and pages[0].sequence == pages[1].sequence
        token = (pages[-1].feed_id, pages[-1].sequence)
        channel.close()

        client.put(f"{prefix}new", b"x")
        client.put("elsewhere/1", b"x")  # another prefix: never sent, but moves the sequence on
        client.remove(keys[0])
        channel, stream = watch(small_feed.master_address, prefix, *token)
        first = next(stream)
        assert not first.snapshot and not first.changes and first.sequence == token[1]  # resumed: no snapshot
        changes = []
        for message in stream:
            changes += [(c.kind, c.key) for c in message.changes]
            if len(changes) >= 2:
                break
        assert changes == [(pb.KEY_STORED, f"{prefix}new"), (pb.KEY_REMOVED, keys[0])]
        assert message.sequence == token[1] + 3
        channel.close()

        client.batch_put([f"{prefix}more-{i}" for i in range(FEED_SIZE + 1)], [b"x"] * (FEED_SIZE + 1))
        channel, stream = watch(small_feed.master_address, prefix, *token)  # fell out of the log
        _, present = read_snapshot(stream)
        channel.close()
        assert f"{prefix}new" in present and keys[0] not in present and len(present) == len(keys) + FEED_SIZE + 1
        channel, stream = watch(small_feed.master_address, prefix, "1-not-this-feed", token[1])
        assert next(stream).snapshot
        channel.close()
        client.remove_prefix(prefix)


def test_a_subscriber_cut_off_and_far_behind_converges_through_a_snapshot(small_feed):
    proxy = Proxy(small_feed.master_address)
    first, later = blocks(4), blocks(FEED_SIZE * 2, salt=1)
    with Client(small_feed.master_address) as client:
        store(client, first)
        subscriber = Subscriber(NAMESPACE, proxy.address)
        try:
            subscriber.wait_for(set(first))
            proxy.cut()
            # More changes than the feed keeps, while the subscriber cannot hear them.
            client.remove(NAMESPACE.key(first[0]))
            client.remove(NAMESPACE.key(first[1]))
            store(client, later)
            proxy.restore()
            subscriber.wait_for(set(first[2:] + later))
            client.remove(NAMESPACE.key(later[0]))  # and it follows changes again afterwards
            subscriber.wait_for(set(first[2:] + later[1:]))
        finally:
            subscriber.stop()
            proxy.close()
            client.remove_prefix(NAMESPACE.prefix())
    assert (REMOVED, first[0]) in subscriber.events and (REMOVED, first[1]) in subscriber.events
    assert subscriber.drift == []


def test_a_subscriber_follows_the_leader_across_a_failover(own_cluster):
    cluster = own_cluster(nodes=2, masters=2, master_args=["--election-ttl", "2"])
    leader, follower = cluster.masters
    hashes = blocks(24)
    with Client(cluster.master_addresses) as client:
        store(client, hashes)
        with master_channel(leader.info["address"]) as channel:
            stub = kvpool_pb2_grpc.MasterStub(channel)
            where = {h: stub.GetReplicaList(pb.GetReplicaListRequest(key=NAMESPACE.key(h)), timeout=5)
                     .object.replicas[0].node_id for h in hashes}
        with master_channel(follower.info["address"]) as channel, pytest.raises(grpc.RpcError) as caught:
            next(kvpool_pb2_grpc.MasterStub(channel).WatchKeys(pb.WatchKeysRequest(prefix="kv/"), timeout=5))
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(caught.value.trailing_metadata())["kvpool-leader"] == leader.info["address"]

        on_survivor = {h for h in hashes if where[h] == "node-0"}
        assert 0 < len(on_survivor) < len(hashes)
        by_masters = Subscriber(NAMESPACE, cluster.master_addresses)
        by_etcd = Subscriber(NAMESPACE, etcd=cluster.etcd_endpoint)
        try:
            by_masters.wait_for(set(hashes))
            by_etcd.wait_for(set(hashes))
            # The leader and the only node holding some blocks die together: the new leader knows
            # what the surviving node holds, so the other blocks are gone.
            leader.kill()
            cluster.nodes[1].kill()
            by_masters.wait_for(on_survivor)
            by_etcd.wait_for(on_survivor)
            fresh = blocks(3, salt=2)
            store(client, fresh)
            gone = min(on_survivor)
            client.remove(NAMESPACE.key(gone))
            for subscriber in (by_masters, by_etcd):
                subscriber.wait_for(on_survivor - {gone} | set(fresh))
            # A graceful stop: the leader ends its streams with NOT_LEADER and the restarted first master
            # (on a new port, which only etcd names) takes over.
            cluster.restart_master(0)
            follower.stop()
            with Client(cluster.masters[0].info["address"]) as again:
                last = blocks(2, salt=3)
                store(again, last)
            by_etcd.wait_for(on_survivor - {gone} | set(fresh) | set(last))
        finally:
            by_masters.stop()
            by_etcd.stop()
    for subscriber in (by_masters, by_etcd):
        assert subscriber.drift == []  # every event changed the index: nothing reported twice
        assert {b for kind, b in subscriber.events if kind == REMOVED} == set(hashes) - on_survivor | {gone}
