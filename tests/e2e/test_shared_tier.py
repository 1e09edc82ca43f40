"""The shared tier against real processes: etcd, a master and storage nodes given one --shared-dir.

Objects go DRAM -> SSD -> the shared directory as the nodes' tiers fill, and come back byte-exact
through a node (the file checked before a byte leaves) and read directly by a client that mounts the
directory; a damaged file is never served; a whole new cluster started over the directory serves every
object it holds; at its capacity the leader's evictions leave concurrent readers no wrong bytes.
"""

import hashlib
import os
import threading
import time

import pytest

from kvpool import Client
from kvpool.errors import ChecksumMismatchError, KeyNotFoundError, KvpoolError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.sharedfs.layout import HEADER_SIZE, parse_header

SIZE = 256 * 1024


def value_of(key: str, size: int = SIZE) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (size // len(seed) + 1))[:size]


def shared_files(shared_dir) -> dict:
    """key -> (generation, path) of every object file in the shared directory (read from their headers)."""
    found = {}
    for root, _dirs, names in os.walk(os.path.join(shared_dir, "default", "objects")):
        for name in names:
            if name.startswith("."):
                continue
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                head = f.read(HEADER_SIZE + 1024)
            obj = parse_header(head)
            key = obj.key.decode()
            if key not in found or found[key][0] < obj.generation:
                found[key] = (obj.generation, path)
    return found


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


@pytest.fixture
def shared_cluster(tmp_path):
    started = []

    def start(name: str = "a", nodes: int = 2, **options):
        options.setdefault("dram_per_node", "8MiB")
        options.setdefault("ssd_per_node", "8MiB")
        # A band wide enough that a batch of puts lands in room the sweep made (objects a WRITE has to evict
        # in place are lost, not moved: storenode/background/shared_tier.py)
        options.setdefault("node_args", ["--high-watermark", "0.8", "--low-watermark", "0.6"])
        running = LocalCluster(nodes=nodes, data_dir=tmp_path / f"cluster-{name}", lease_ttl=2, put_timeout=3,
                               shared_dir=tmp_path / "shared", **options).start()
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


def test_objects_demoted_to_the_shared_tier_read_back_through_a_node_and_directly(shared_cluster, tmp_path):
    cluster = shared_cluster()
    with Client(cluster.master_address) as client:
        keys = fill(cluster, client, 160)  # 40 MiB: twice the nodes' DRAM and SSD
        wait_until(lambda: shared_objects(cluster) >= 40, 30, what="objects in the shared tier")
        on_disk = shared_files(tmp_path / "shared")
        assert len(on_disk) >= 40
        for key in keys:  # every object: in a node's DRAM or SSD, or in the shared tier through a node
            assert client.get(key) == value_of(key), key
        assert client.bytes_by_transport().get("shared", 0) == 0
        # Read twice through a node, a shared object is copied into its DRAM: the master then names that copy.
        hot = next(key for key in keys if key in on_disk)
        assert client.get(hot) == value_of(hot)
        wait_until(lambda: shared_promotions(cluster) >= 1, 10, what="a shared object read twice to be promoted")
    with Client(cluster.master_address, shared_dir=str(tmp_path / "shared")) as direct:
        for key in on_disk:
            if key in keys:
                try:
                    assert direct.get(key) == value_of(key), key
                except KeyNotFoundError:  # promoted and evicted since, or evicted at capacity: never wrong bytes
                    pass
        assert direct.bytes_by_transport().get("shared", 0) >= 20 * SIZE


def test_a_damaged_or_torn_file_is_never_served(shared_cluster, tmp_path):
    cluster = shared_cluster()
    shared_dir = tmp_path / "shared"
    with Client(cluster.master_address) as client:
        fill(cluster, client, 160)
        wait_until(lambda: len(shared_files(shared_dir)) >= 10, 30, what="objects in the shared tier")
        files = sorted(shared_files(shared_dir).items())
        flipped, torn = files[0], files[1]
        with open(flipped[1][1], "r+b") as f:  # one payload byte flipped
            f.seek(-1000, os.SEEK_END)
            byte = f.read(1)
            f.seek(-1000, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0x40]))
        with open(torn[1][1], "r+b") as f:  # cut short, as a copy torn by a crash would be
            f.truncate(HEADER_SIZE + 100)
        with Client(cluster.master_address, shared_dir=str(shared_dir)) as direct:
            for key, _ in (flipped, torn):
                for reader in (client, direct):
                    with pytest.raises((ChecksumMismatchError, KeyNotFoundError)):
                        reader.get(key)
            untouched = files[2][0]
            assert direct.get(untouched) == value_of(untouched)


def test_a_new_cluster_over_the_same_directory_serves_every_shared_object(shared_cluster, tmp_path):
    first = shared_cluster("first")
    shared_dir = tmp_path / "shared"
    with Client(first.master_address) as client:
        keys = fill(first, client, 160)
        wait_until(lambda: shared_objects(first) >= 40, 30, what="objects in the shared tier")
        client.remove(keys[-1])  # the newest, still in DRAM: gone, wherever it was
        overwritten = next(k for k in keys if k in shared_files(shared_dir))
        client.put(overwritten, value_of(overwritten + "-v2"), overwrite=True)
    held = {key: gen for key, (gen, _) in shared_files(shared_dir).items()}
    for child in (*first.nodes, *first.masters):  # every node and master killed at once
        child.kill()
    first.stop()
    started = time.monotonic()
    second = shared_cluster("second")  # new etcd, master and nodes; only the directory is the same
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


def test_eviction_at_capacity_leaves_concurrent_readers_no_wrong_bytes(shared_cluster, tmp_path):
    cluster = shared_cluster(ssd_per_node="0", shared_capacity="6MiB")
    shared_dir = tmp_path / "shared"
    stop, wrong, read = threading.Event(), [], [0]

    def reader(keys: list[str], direct: bool) -> None:
        options = {"shared_dir": str(shared_dir)} if direct else {}
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
    wait_until(lambda: sum(os.path.getsize(p) for _, p in shared_files(shared_dir).values()) <= 7 * 1024 * 1024,
               20, what="the evicted files to be unlinked")


def test_a_put_to_the_shared_tier_lands_there_and_reads_back(shared_cluster, tmp_path):
    cluster = shared_cluster(nodes=1)
    with Client(cluster.master_address) as client:
        keys = [f"through-{i}" for i in range(8)]
        client.batch_put(keys, [value_of(k) for k in keys], tier="shared")
        wait_until(lambda: shared_objects(cluster) == 8, 20, what="the puts to move on to the shared tier")
        assert sorted(shared_files(tmp_path / "shared")) == sorted(keys)
        assert [client.get(k) for k in keys] == [value_of(k) for k in keys]
        with pytest.raises(KvpoolError, match="tier must be"):
            client.put("bad", b"x", tier="nfs")
