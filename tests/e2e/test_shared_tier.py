"""The shared tier against real processes: etcd, a master and storage nodes given one --shared-dir, or one
--object-store bucket on a real S3 server (SeaweedFS's gateway), plain or encrypted: every test runs on each.

Objects go DRAM -> SSD -> the shared tier as the nodes' tiers fill, and come back byte-exact through a node (the
object checked before a byte leaves) and read directly by a client that reaches the directory or the bucket; a
damaged object is never served; a whole new cluster started over the directory or bucket serves every object it
holds; at its capacity the leader's evictions leave concurrent readers no wrong bytes.
"""

import hashlib
import os
import threading
import time

import pytest

from kvpool import Client
from kvpool.errors import ChecksumMismatchError, KeyNotFoundError, KvpoolError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.launch.s3_server import S3Server
from kvpool.net.netutil import wait_until
from kvpool.objectstore.bucket import Bucket
from kvpool.objectstore.sealing import ObjectCipher
from kvpool.security import auth
from kvpool.proto import kvpool_pb2 as pb
from kvpool.sharedfs.layout import HEADER_SIZE, parse_header

SIZE = 256 * 1024


def value_of(key: str, size: int = SIZE) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (size // len(seed) + 1))[:size]


class SharedFiles:
    """The shared tier as a directory: its objects by key, and what a test does to them."""

    def __init__(self, root):
        self.root = root
        self.cluster_options = {"shared_dir": root}
        self.client_options = {"shared_dir": str(root)}

    def objects(self) -> dict:
        """key -> (generation, path) of every object file (read from their headers)."""
        found = {}
        for root, _dirs, names in os.walk(os.path.join(self.root, "default", "objects")):
            for name in names:
                if name.startswith("."):
                    continue
                path = os.path.join(root, name)
                with open(path, "rb") as f:
                    _newest(found, parse_header(f.read(HEADER_SIZE + 1024)), path)
        return found

    def rewrite(self, name, change) -> None:
        with open(name, "rb") as f:
            data = f.read()
        with open(name, "wb") as f:
            f.write(change(data))

    def total_bytes(self) -> int:
        return sum(os.path.getsize(name) for _, name in self.objects().values())


class SharedBucket:
    """The shared tier as a bucket's prefix: the same, through the S3 API. `encrypted`: what the nodes write there
    is sealed (?encryption=aes-gcm); the test opens it with the key the cluster's secret gives."""

    def __init__(self, server, prefix: str, encrypted: bool = False):
        self.bucket = Bucket(server.settings(prefix))
        url = f"s3://{server.bucket}/{prefix}" + ("?encryption=aes-gcm" if encrypted else "")
        self.cluster_options = {"object_store": url}
        self.client_options = {"object_store": url}
        self.encrypted = encrypted
        self.secret = None  # the cluster's, once one started (an encrypted tier's key comes from it)

    def objects(self) -> dict:
        found = {}
        cipher = ObjectCipher(auth.object_tier_key(self.secret)) if self.encrypted else None
        for page in self.bucket.list("default/objects/"):
            for name, _size in page:
                if cipher is None:
                    [head] = self.bucket.get_ranges(name, [0], [HEADER_SIZE + 1024])
                else:  # sealed whole: nothing of it can be read without opening all of it, not even its key
                    stored = bytes(self.bucket.get(name))
                    head = cipher.open(name, stored)
                    assert parse_header(head).key not in stored and head[-64:] not in stored
                _newest(found, parse_header(head), name)
        return found

    def rewrite(self, name, change) -> None:
        self.bucket.put(name, change(bytes(self.bucket.get(name))))

    def total_bytes(self) -> int:
        return sum(size for page in self.bucket.list("default/objects/") for _, size in page)


def _newest(found: dict, obj, name) -> None:
    key = obj.key.decode()
    if key not in found or found[key][0] < obj.generation:
        found[key] = (obj.generation, name)


def shared_objects(cluster) -> int:
    stats = cluster.master_stats()
    return stats.shared.objects if stats.HasField("shared") else 0


def shared_promotions(cluster) -> int:
    return sum(t.promotions for n in cluster.master_stats().nodes for t in n.tiers if t.tier == pb.DRAM)


def fill(cluster, client, count: int, prefix: str = "k") -> list[str]:
    """Put `count` objects in batches, each batch once the nodes' DRAM is back under its high watermark (the
    sweep moves the coldest on): what does not fit in DRAM and SSD ends up in the shared tier."""
    keys = [f"{prefix}{i:05d}" for i in range(count)]
    for start in range(0, count, 8):
        batch = keys[start:start + 8]
        client.batch_put(batch, [value_of(k) for k in batch])
        wait_until(lambda: all(t.used <= 0.8 * t.capacity for n in cluster.master_stats().nodes for t in n.tiers),
                   20, what="the nodes' tiers to come back under their high watermark")
    return keys


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3") / "data") as running:
        yield running


@pytest.fixture(params=["directory", "bucket", "encrypted"])
def tier(request, tmp_path):
    if request.param == "directory":
        return SharedFiles(tmp_path / "shared")
    server = request.getfixturevalue("s3_server")
    monkeypatch = request.getfixturevalue("monkeypatch")
    for name, value in server.environment.items():  # as the nodes and the clients read them
        monkeypatch.setenv(name, value)
    return SharedBucket(server, f"{request.node.name}/", request.param == "encrypted")


# Sealing is below every step these take: run on the two stores, not again encrypted (the suite's time)
PLAIN = pytest.mark.parametrize("tier", ["directory", "bucket"], indirect=True)


@pytest.fixture
def shared_cluster(tmp_path, tier):
    started = []

    def start(name: str = "a", nodes: int = 2, **options):
        options.setdefault("dram_per_node", "8MiB")
        options.setdefault("ssd_per_node", "8MiB")
        # A band wide enough that a batch of puts lands in room the sweep made (objects a WRITE has to evict
        # in place are lost, not moved: storenode/background/shared_tier.py)
        options.setdefault("node_args", ["--high-watermark", "0.8", "--low-watermark", "0.6"])
        running = LocalCluster(nodes=nodes, data_dir=tmp_path / f"cluster-{name}", lease_ttl=2, put_timeout=3,
                               **tier.cluster_options, **options).start()
        started.append(running)
        if getattr(tier, "encrypted", False):  # (every cluster here has this process's secret)
            assert tier.secret in (None, running.secret)
            tier.secret = running.secret
        return running

    yield start
    for running in started:
        running.stop()


def test_objects_demoted_to_the_shared_tier_read_back_through_a_node_and_directly(shared_cluster, tier):
    cluster = shared_cluster()
    with Client(cluster.master_address) as client:
        keys = fill(cluster, client, 160)  # 40 MiB: twice the nodes' DRAM and SSD
        wait_until(lambda: shared_objects(cluster) >= 40, 30, what="objects in the shared tier")
        on_disk = tier.objects()
        assert len(on_disk) >= 40
        for key in keys:  # every object: in a node's DRAM or SSD, or in the shared tier through a node
            assert client.get(key) == value_of(key), key
        assert client.bytes_by_transport().get("shared", 0) == 0
        # Read twice through a node, a shared object is copied into its DRAM: the master then names that copy.
        hot = next(key for key in keys if key in on_disk)
        assert client.get(hot) == value_of(hot)
        wait_until(lambda: shared_promotions(cluster) >= 1, 10, what="a shared object read twice to be promoted")
    with Client(cluster.master_address, **tier.client_options) as direct:
        for key in on_disk:
            if key in keys:
                try:
                    assert direct.get(key) == value_of(key), key
                except KeyNotFoundError:  # promoted and evicted since, or evicted at capacity: never wrong bytes
                    pass
        assert direct.bytes_by_transport().get("shared", 0) >= 20 * SIZE


def test_a_damaged_or_torn_file_is_never_served(shared_cluster, tier):
    cluster = shared_cluster()
    with Client(cluster.master_address) as client:
        fill(cluster, client, 160)
        wait_until(lambda: len(tier.objects()) >= 10, 30, what="objects in the shared tier")
        files = sorted(tier.objects().items())
        flipped, torn = files[0], files[1]
        tier.rewrite(flipped[1][1], lambda data: data[:-1000] + bytes([data[-1000] ^ 0x40]) + data[-999:])
        tier.rewrite(torn[1][1], lambda data: data[:HEADER_SIZE + 100])  # cut short, as a torn copy would be
        with Client(cluster.master_address, **tier.client_options) as direct:
            for key, _ in (flipped, torn):
                for reader in (client, direct):
                    with pytest.raises((ChecksumMismatchError, KeyNotFoundError)):
                        reader.get(key)
            untouched = files[2][0]
            assert direct.get(untouched) == value_of(untouched)


def test_a_new_cluster_over_the_same_directory_serves_every_shared_object(shared_cluster, tier):
    first = shared_cluster("first")
    with Client(first.master_address) as client:
        keys = fill(first, client, 160)
        wait_until(lambda: shared_objects(first) >= 40, 30, what="objects in the shared tier")
        client.remove(keys[-1])  # the newest, still in DRAM: gone, wherever it was
        overwritten = next(k for k in keys if k in tier.objects())
        client.put(overwritten, value_of(overwritten + "-v2"), overwrite=True)
    held = {key: gen for key, (gen, _) in tier.objects().items()}
    for child in (*first.nodes, *first.masters):  # every node and master killed at once
        child.kill()
    first.stop()
    started = time.monotonic()
    second = shared_cluster("second")  # new etcd, master and nodes; only the directory (bucket) is the same
    with Client(second.master_address) as client:
        served = 0
        for key in held:
            if key == overwritten:
                continue  # its new version was in DRAM: lost with the nodes, and the old one never comes back
            assert client.get(key) == value_of(key), key
            served += 1
        adopted_in = time.monotonic() - started
        with pytest.raises(KeyNotFoundError):
            client.get(overwritten)
        with pytest.raises(KeyNotFoundError):
            client.get(keys[-1])
    assert served >= 39
    print(f"\nshared objects adopted by a new cluster: {served} in {adopted_in:.2f}s (start and reads included)")


@PLAIN
def test_eviction_at_capacity_leaves_concurrent_readers_no_wrong_bytes(shared_cluster, tier):
    cluster = shared_cluster(ssd_per_node="0", shared_capacity="6MiB")
    stop, wrong, read = threading.Event(), [], [0]

    def reader(keys: list[str], direct: bool) -> None:
        options = tier.client_options if direct else {}
        with Client(cluster.master_address, **options) as c:
            while not stop.is_set():
                for key in keys:
                    try:
                        value = c.get(key)
                    except KvpoolError:
                        continue  # evicted: missing, never wrong
                    read[0] += 1
                    if value != value_of(key):
                        wrong.append(key)
    with Client(cluster.master_address) as client:
        first = fill(cluster, client, 64, "first-")
        threads = [threading.Thread(target=reader, args=(first, direct)) for direct in (False, True)]
        for thread in threads:
            thread.start()
        try:
            fill(cluster, client, 128, "more-")  # 48 MiB more through 16 MiB of DRAM into 6 MiB of shared tier
            wait_until(lambda: cluster.master_stats().shared.used <= 6 * 1024 * 1024, 20,
                       what="the leader to bring the shared tier within its capacity")
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
    assert not wrong
    assert read[0] > 0
    stats = cluster.master_stats().shared
    assert stats.capacity == 6 * 1024 * 1024 and stats.servers == 2
    wait_until(lambda: tier.total_bytes() <= 7 * 1024 * 1024, 20, what="the evicted objects to be removed")


@PLAIN
def test_a_put_to_the_shared_tier_lands_there_and_reads_back(shared_cluster, tier):
    cluster = shared_cluster(nodes=1)
    with Client(cluster.master_address) as client:
        keys = [f"through-{i}" for i in range(8)]
        client.batch_put(keys[:4], [value_of(k) for k in keys[:4]], tier="shared")
        client.batch_put(keys[4:], [value_of(k) for k in keys[4:]], tier="object")  # its name as a bucket
        wait_until(lambda: shared_objects(cluster) == 8, 20, what="the puts to move on to the shared tier")
        assert sorted(tier.objects()) == sorted(keys)
        assert [client.get(k) for k in keys] == [value_of(k) for k in keys]
        with pytest.raises(KvpoolError, match="tier must be"):
            client.put("bad", b"x", tier="nfs")
