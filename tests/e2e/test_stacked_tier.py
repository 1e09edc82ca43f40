"""The shared tier in a directory with a bucket beneath it (--shared-dir and --object-store both; kvpool/objectstore/
stacked.py), on a real directory and a real S3 server (SeaweedFS's gateway): a node's files beyond its share move on
to the bucket, oldest first, and every object reads back from either; removals reach both; a scan keeps each key's
newest version of the two, once; a version freed while it was being moved is not left live in the bucket; a cluster
over both serves every object through a node and directly, and a new cluster over them serves them all again."""

import hashlib

import pytest

from kvpool import Client
from kvpool.launch.local_cluster import LocalCluster
from kvpool.launch.s3_server import S3Server
from kvpool.net.netutil import wait_until
from kvpool.objectstore.bucket import Bucket
from kvpool.objectstore.stacked import StackedTier
from kvpool.objectstore.tier import BucketTier
from kvpool.protocol import inventory
from kvpool.protocol.checksum import checksum
from kvpool.sharedfs.files import SharedDir
from kvpool.sharedfs.layout import HEADER_SIZE, SharedObject


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3") / "data") as running:
        yield running


def item(key: bytes, generation: int, size: int = 4096, expires_ms: int = 0):
    payload = (hashlib.blake2b(key + bytes([generation]), digest_size=64).digest() * (size // 64 + 1))[:size]
    return SharedObject(key, generation, size, checksum(payload), 0, size, expires_ms), payload


def stacked(tmp_path, server, name: str, share: int, writer: str | None = "node-0-a") -> StackedTier:
    bucket = Bucket(server.settings(f"{name}/"))
    (tmp_path / "dir").mkdir(exist_ok=True)  # (a mount: the tier makes nothing above its cluster's folder)
    upper = SharedDir(str(tmp_path / "dir"), "c", writer) if writer else SharedDir.reader(str(tmp_path / "dir"), "c")
    return StackedTier(upper, BucketTier(bucket, "c", writer), share)


def scanned(tier, now_ms: int = 1) -> dict:
    return {entry.key.encode(): entry.generation for entry in inventory.decode(tier.scan(now_ms).reply)}


def test_files_beyond_the_share_move_to_the_bucket_oldest_first_and_read_back_from_either(tmp_path, server):
    size = 4096 + HEADER_SIZE + 3
    with stacked(tmp_path, server, "spill", share=3 * size) as tier:
        items = [item(f"k{i:02d}".encode(), 1) for i in range(10)]
        tier.write_many(items)
        assert tier.spill() == 7 and tier.spill() == 0  # the 7 oldest went on; 3 files' worth stay
        in_dir = {obj.key for obj, _ in items if tier.upper.exists(obj.key, 1)}
        in_bucket = {obj.key for obj, _ in items if tier.lower.exists(obj.key, 1)}
        assert in_dir == {b"k07", b"k08", b"k09"} and in_bucket == {f"k{i:02d}".encode() for i in range(7)}
        for obj, payload in items:
            assert tier.read(obj.key, 1)[1] == payload
            dest = bytearray(obj.size)
            tier.read_into(obj.key, 1, obj.size, obj.checksum, dest)
            assert dest == payload
        assert tier.remove_many([(b"k00", 1), (b"k09", 1), (b"none", 1)])[:2] == [True, True]  # (S3's DELETE
        # does not say whether there was one)
        assert not tier.exists(b"k00", 1) and not tier.exists(b"k09", 1)
        assert scanned(tier) == {f"k{i:02d}".encode(): 1 for i in range(1, 9)}
    # a reader's view (a client's) of both reads the same
    reader = StackedTier(SharedDir.reader(str(tmp_path / "dir"), "c"), BucketTier.reader(
        Bucket(server.settings("spill/")), "c"), 0)
    assert reader.read(b"k03", 1)[1] == items[3][1] and reader.read(b"k08", 1)[1] == items[8][1]


def test_a_scan_keeps_each_keys_newest_version_of_the_two_stores_once(tmp_path, server):
    with stacked(tmp_path, server, "merge", share=1 << 30) as tier:
        tier.upper.write_many([item(b"both", 2), item(b"dir-newer", 3), item(b"bucket-newer", 1),
                               item(b"expired-newest", 5, expires_ms=100)])
        tier.lower.write_many([item(b"both", 2), item(b"dir-newer", 1), item(b"bucket-newer", 4),
                               item(b"expired-newest", 2), item(b"bucket-only", 1)])
        scan = tier.scan(1000)
        found = {entry.key: entry.generation for entry in inventory.decode(scan.reply)}
        assert found == {"both": 2, "dir-newer": 3, "bucket-newer": 4, "bucket-only": 1}
        assert sorted((o.key, o.generation) for o in scan.superseded) == [
            (b"bucket-newer", 1), (b"dir-newer", 1), (b"expired-newest", 2)]
        assert [(o.key, o.generation) for o in scan.expired] == [(b"expired-newest", 5)]
        # the directory's files of the versions kept are this node's to move on (the superseded are the caller's
        # to remove)
        tier.share = 0
        assert tier.spill() == 2 and not any(tier.upper.exists(k, g) for k, g in ((b"both", 2), (b"dir-newer", 3)))
        assert {e.key: e.generation for e in inventory.decode(tier.scan(1000).reply)} == found


def test_a_version_freed_while_it_moves_is_not_left_live_in_the_bucket(tmp_path, server):
    with stacked(tmp_path, server, "race", share=0) as tier:
        tier.write_many([item(b"moving", 1), item(b"kept", 1)])
        write_many, removal = tier.lower.write_many, []

        def landing(items):  # the leader frees one of them just before the bucket takes the batch
            removal.append(tier.remove_many([(b"moving", 1)]))
            return write_many(items)

        tier.lower.write_many = landing
        assert tier.spill() == 2
        assert removal == [[True]]  # its file was still in the directory
        assert not tier.exists(b"moving", 1) and tier.exists(b"kept", 1)
        assert scanned(tier) == {b"kept": 1}  # its REMOVED record came after the move's ADDED one


SIZE = 256 * 1024


def value_of(key: str) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (SIZE // 64 + 1))[:SIZE]


def test_a_cluster_over_a_directory_and_a_bucket_serves_every_object_and_so_does_the_next(tmp_path, server,
                                                                                          monkeypatch):
    for name, value in server.environment.items():
        monkeypatch.setenv(name, value)
    options = dict(nodes=2, dram_per_node="8MiB", ssd_per_node="8MiB", lease_ttl=2, put_timeout=3,
                   shared_dir=tmp_path / "shared", object_store=f"s3://{server.bucket}/cluster/",
                   node_args=["--high-watermark", "0.8", "--low-watermark", "0.6", "--shared-dir-share", "2MiB"])
    bucket = Bucket(server.settings("cluster/"))

    def in_bucket() -> int:
        return sum(len(page) for page in bucket.list("default/objects/"))

    keys = [f"s{i:04d}" for i in range(160)]  # 40 MiB: twice the nodes' DRAM and SSD
    first = LocalCluster(data_dir=tmp_path / "first", **options).start()
    try:
        with Client(first.master_address) as client:
            for start in range(0, len(keys), 8):
                client.batch_put(keys[start:start + 8], [value_of(k) for k in keys[start:start + 8]])
                wait_until(lambda: all(t.used <= 0.8 * t.capacity for n in first.master_stats().nodes
                                       for t in n.tiers), 20, what="the nodes' tiers under their high watermark")
            wait_until(lambda: in_bucket() >= 20, 30, what="files moved on to the bucket")
            for key in keys:
                assert client.get(key) == value_of(key), key
        with Client(first.master_address, shared_dir=str(tmp_path / "shared"),
                    object_store=f"s3://{server.bucket}/cluster/") as direct:
            for key in keys:
                assert direct.get(key) == value_of(key), key
            assert direct.bytes_by_transport().get("shared", 0) >= 20 * SIZE
        shared = first.master_stats().shared.objects
        for child in (*first.nodes, *first.masters):  # every node and master killed at once
            child.kill()
    finally:
        first.stop()
    again = LocalCluster(data_dir=tmp_path / "again", **options).start()
    try:
        wait_until(lambda: again.master_stats().shared.objects >= shared, 30, what="the shared objects adopted")
        with Client(again.master_address) as client:
            served = [key for key in keys if client.exists(key)]
            assert len(served) >= shared
            for key in served:
                assert client.get(key) == value_of(key), key
    finally:
        again.stop()
