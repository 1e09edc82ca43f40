"""The deep tier's objects in a real S3 bucket (kvpool/objectstore/tier.py over SeaweedFS's gateway): written,
read whole and into buffers (large ones by parallel ranged GETs), removed, and found again by a scan of the
manifests alone; a damaged, truncated or misplaced object is never served; a writer restarted under its name
never overwrites its earlier manifests; an encrypted tier writes nothing in the clear and uses nothing else."""

import dataclasses
import os

import pytest

from kvpool.errors import ChecksumMismatchError, InvalidArgumentError, KeyNotFoundError
from kvpool.launch.s3_server import S3Server
from kvpool.objectstore import tier as tier_module
from kvpool.objectstore.bucket import Bucket
from kvpool.objectstore.tier import BucketTier
from kvpool.protocol import inventory
from kvpool.protocol.checksum import checksum
from kvpool.security import auth
from kvpool.sharedfs.layout import HEADER_SIZE, SharedObject

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3") / "data") as running:
        yield running


@pytest.fixture
def bucket(server, request):
    return Bucket(server.settings(f"{request.node.name}/"))


def item(key: bytes, generation: int, payload: bytes, expires_ms: int = 0):
    return SharedObject(key, generation, len(payload), checksum(payload), 0, len(payload), expires_ms), payload


def scanned(tier: BucketTier, now_ms: int = 1) -> dict:
    return {entry.key.encode(): entry.generation for entry in inventory.decode(tier.scan(now_ms).reply)}


def test_written_objects_read_back_and_are_found_by_the_manifests_alone(bucket):
    with BucketTier(bucket, "c1", "node-0-a") as tier:
        small, large = os.urandom(1000), os.urandom(3 << 20)
        assert tier.write_many([item(b"k/small", 1, small), item(b"k/large", 7, large)]) == \
            [len(small) + HEADER_SIZE + len(b"k/small"), len(large) + HEADER_SIZE + len(b"k/large")]
        obj, payload = tier.read(b"k/large", 7)
        assert payload == large and (obj.size, obj.generation) == (len(large), 7)
        dest = bytearray(len(small))
        tier.read_into(b"k/small", 1, len(small), checksum(small), dest)
        assert dest == small
        assert tier.exists(b"k/small", 1) and not tier.exists(b"k/small", 2)
        with pytest.raises(KeyNotFoundError):
            tier.read(b"k/small", 2)
        tier.write(*item(b"k/small", 3, b"newer"))  # a newer version: the scan names it alone
        assert scanned(tier) == {b"k/large": 7, b"k/small": 3}
        assert tier.remove_many([(b"k/large", 7)]) == [True]
        assert scanned(tier) == {b"k/small": 3}
        with pytest.raises(KeyNotFoundError):
            tier.read(b"k/large", 7)
        scan = tier.scan(1)
        assert [o.generation for o in scan.superseded] == [1] and scan.manifests == 1 and scan.records == 4
    # another process (another writer) sees the same, and its removal of this writer's object counts
    with BucketTier(bucket, "c1", "node-1-b") as other:
        assert scanned(other) == {b"k/small": 3}
        other.remove(b"k/small", 3)
        assert scanned(other) == {b"k/small": 1}  # the older version's object was never removed (a scan's
        other.remove(b"k/small", 1)               # caller removes superseded ones, as the shared tier's does)
        assert scanned(other) == {}
    assert scanned(BucketTier.reader(bucket, "c2")) == {}  # another cluster's prefix: nothing


def test_large_objects_are_read_by_parallel_ranges(bucket, monkeypatch):
    monkeypatch.setattr(tier_module, "RANGE_SIZE", 1 << 20)
    payload = os.urandom((5 << 20) + 123)
    with BucketTier(bucket, "c", "w") as tier:
        tier.write(*item(b"big", 1, payload))
        calls = []
        ranges = bucket.get_ranges
        monkeypatch.setattr(bucket, "get_ranges", lambda name, s, e: calls.append(len(s)) or ranges(name, s, e))
        dest = bytearray(len(payload))
        tier.read_into(b"big", 1, len(payload), checksum(payload), dest)
        assert dest == payload and calls == [6]
        with pytest.raises(ChecksumMismatchError, match="expected"):  # not the placement's version
            tier.read_into(b"big", 1, len(payload), checksum(payload) ^ 1, bytearray(len(payload)))


def test_damaged_truncated_and_misplaced_objects_are_never_served(bucket):
    with BucketTier(bucket, "c", "w") as tier:
        payload = os.urandom(4096)
        tier.write_many([item(b"a", 1, payload), item(b"b", 1, payload)])
        name = tier.path(b"a", 1)
        whole = bytes(bucket.get(name))
        flipped = bytearray(whole)
        flipped[-1] ^= 0x40
        bucket.put(name, bytes(flipped))
        for read in (lambda: tier.read(b"a", 1),
                     lambda: tier.read_into(b"a", 1, len(payload), checksum(payload), bytearray(len(payload)))):
            with pytest.raises(ChecksumMismatchError, match="damaged"):
                read()
        bucket.put(name, whole[:-100])
        with pytest.raises(ChecksumMismatchError, match="truncated"):
            tier.read(b"a", 1)
        with pytest.raises(ChecksumMismatchError, match="truncated"):
            tier.read_into(b"a", 1, len(payload), checksum(payload), bytearray(len(payload)))
        header = bytearray(whole)
        header[0] ^= 1
        bucket.put(name, bytes(header))
        with pytest.raises(ChecksumMismatchError, match="magic"):
            tier.read(b"a", 1)
        bucket.put(tier.path(b"a", 2), bytes(bucket.get(tier.path(b"b", 1))))  # b's object under a's name
        with pytest.raises(ChecksumMismatchError, match="misplaced"):
            tier.read(b"a", 2)


def test_a_writer_restarted_under_its_name_appends_after_its_manifests(bucket):
    with BucketTier(bucket, "c", "node-0") as first:
        first.write(*item(b"x", 1, b"one"))
        first.write(*item(b"y", 1, b"two"))
    with BucketTier(bucket, "c", "node-0") as again:
        again.write(*item(b"z", 1, b"three"))
        assert scanned(again) == {b"x": 1, b"y": 1, b"z": 1}
    names = [name for page in bucket.list("c/manifests/node-0/") for name, _ in page]
    assert [n.rsplit("/", 1)[1] for n in names] == [f"{i:016x}.log" for i in range(3)]


def test_expired_objects_are_not_adopted_and_readers_write_nothing(bucket):
    with BucketTier(bucket, "c", "w") as tier:
        tier.write_many([item(b"old", 1, b"v", expires_ms=1000), item(b"new", 1, b"v", expires_ms=10_000)])
        assert scanned(tier, now_ms=5000) == {b"new": 1}
        assert [o.key for o in tier.scan(5000).expired] == [b"old"]
    reader = BucketTier.reader(bucket, "c")
    with pytest.raises(InvalidArgumentError, match="writes nothing"):
        reader.write(*item(b"k", 1, b"v"))
    with pytest.raises(InvalidArgumentError, match="of size"):
        BucketTier(bucket, "c", "w").write(SharedObject(b"k", 1, 10, 0, 0, 10, 0), b"short")
    with pytest.raises(InvalidArgumentError, match="plain file name"):
        BucketTier(bucket, "c/d", "w")



def test_a_scan_past_many_manifests_folds_them_into_a_few(bucket, monkeypatch):
    monkeypatch.setattr(tier_module, "COMPACT_AFTER", 8)
    monkeypatch.setattr(tier_module, "SNAPSHOT_RECORDS", 5)
    with BucketTier(bucket, "c", "writer-a") as a, BucketTier(bucket, "c", "writer-b") as b:
        for i in range(12):  # 12 manifest objects of one record each, over two writers
            (a if i % 2 else b).write(*item(f"key-{i:02d}".encode(), 1, b"v", expires_ms=10_000 if i == 3 else 0))
        b.remove(b"key-00", 1)
        before = scanned(a)
        assert len(before) == 11 and b"key-00" not in before
        a.wait_for_folds(30)
        manifests = [name for page in bucket.list("c/manifests/") for name, _ in page]
        assert len(manifests) == 3  # a's 11 live objects, 5 to a manifest object; the 13 folded are gone
        assert scanned(b) == before
        b.write(*item(b"key-99", 1, b"v"))  # writers go on after a compaction: their records still count
        a.remove(b"key-05", 1)
        after = scanned(b)
        assert b"key-99" in after and b"key-05" not in after and len(after) == 11
        assert [o.key for o in a.scan(20_000).expired] == [b"key-03"]  # its expiry kept through the fold


SECRET = "5e" * 32


def test_an_encrypted_tier_seals_every_object_and_manifest_and_opens_only_its_own(server, request, monkeypatch):
    prefix = f"{request.node.name}/"
    sealed = Bucket(dataclasses.replace(server.settings(prefix), encryption="aes-gcm"))
    plain = Bucket(server.settings(prefix))
    monkeypatch.setattr(tier_module, "RANGE_SIZE", 1 << 20)
    small, large = os.urandom(1000), os.urandom((3 << 20) + 5)
    with BucketTier(sealed, "c", "w", SECRET) as tier:
        tier.write_many([item(b"k/small", 1, small), item(b"k/large", 1, large)])
        assert tier.read(b"k/small", 1)[1] == small
        dest = bytearray(len(large))
        tier.read_into(b"k/large", 1, len(large), checksum(large), dest)  # ranged GETs, opened whole
        assert dest == large
        stored = [bytes(plain.get(name)) for page in plain.list("c/") for name, _ in page]
        assert len(stored) == 3 and all(data.startswith(b"KVPAEAD1") for data in stored)
        assert not any(b"k/small" in data or small[:64] in data for data in stored)
    # a reader with the client token opens them; one without the option, or with another secret, does not
    with BucketTier(sealed, "c", None, auth.client_token(SECRET)) as reader:
        assert reader.read(b"k/small", 1)[1] == small and scanned(reader) == {b"k/small": 1, b"k/large": 1}
    with pytest.raises(ChecksumMismatchError, match="is encrypted"):
        BucketTier.reader(plain, "c").read(b"k/small", 1)
    with pytest.raises(ChecksumMismatchError, match="another key"):
        BucketTier(sealed, "c", None, "6f" * 32).read(b"k/small", 1)
    assert scanned(BucketTier(sealed, "c", None, "6f" * 32)) == {}  # its manifests skipped, said in the log
    with pytest.raises(ValueError, match="cluster secret"):
        BucketTier(sealed, "c", "w2")
    # an object or manifest written in the clear beside them (by anyone with the bucket's key) is never used
    with BucketTier(plain, "c", "intruder") as intruder:
        intruder.write(*item(b"k/small", 2, b"planted"))
    with BucketTier(sealed, "c", "w", SECRET) as tier:
        with pytest.raises(ChecksumMismatchError, match="not encrypted"):
            tier.read(b"k/small", 2)
        monkeypatch.setattr(tier_module, "COMPACT_AFTER", 1)
        assert scanned(tier) == {b"k/small": 1, b"k/large": 1}  # and a compaction leaves the skipped one be
    assert [n for page in plain.list("c/manifests/intruder/") for n, _ in page]
