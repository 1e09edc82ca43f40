"""The shared tier's files (kvpool/sharedfs): the formats pinned by golden bytes, and SharedDir on a local
directory: what it writes reads back whole, anything damaged, torn or misplaced is refused, and the scan folds
every writer's manifest into the tier's contents."""

import contextlib
import os
import resource
import signal
import stat
import subprocess
import sys

import numpy as np
import pytest

from kvpool.errors import BatchError, ChecksumMismatchError, InvalidArgumentError, KeyNotFoundError, UnavailableError
from kvpool.protocol.checksum import checksum
from kvpool.protocol.inventory import SHARED_BIT, Entry, decode
from kvpool.protocol.keys import MAX_KEY_BYTES
from kvpool.sharedfs.files import SharedDir
from kvpool.sharedfs.layout import (ADDED, HEADER_SIZE, REMOVED, SharedObject, object_name, pack_header,
                                    pack_record, parse_header, parse_records)

NOW_MS = 1_800_000_000_000
GOLDEN = SharedObject(b"model-x/block-00af", 0x1234, 5, checksum(b"hello"), 0x0003, 10, 1_700_000_000_000)
GOLDEN_HEADER = bytes.fromhex(
    "4b56505348523031" "1200" "0300" "00000000" "3412000000000000" "0500000000000000" "fddc625c55e85595"
    "0a00000000000000" "0068e5cf8b010000" "fc00975c64446558") + b"model-x/block-00af"
GOLDEN_RECORD = bytes.fromhex(
    "41000000" "73acc7fd96b18576"  # body length 65, xxh3_64 of the body
    "3412000000000000" "0500000000000000" "fddc625c55e85595" "0a00000000000000" "0068e5cf8b010000" "03000000"
    "1200" "01") + b"model-x/block-00af"


def shared_object(key: bytes, generation: int, payload: bytes, expires_ms: int = 0) -> SharedObject:
    return SharedObject(key, generation, len(payload), checksum(payload), 1, len(payload) * 2, expires_ms)


@pytest.fixture
def shared(tmp_path):
    with SharedDir(str(tmp_path), "cluster-a", "node-1-0") as directory:
        yield directory


def files_under(directory: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, name), directory) for d, _, names in os.walk(directory)
                  for name in names)


# -- formats -----------------------------------------------------------------------------------------------

def test_an_object_file_is_named_from_its_key_and_generation():
    name = object_name(b"model-x/block-00af", 0x1234)
    assert name == "08/f1/08f105c3b4c49c78d10acc1ab533476b-0000000000001234"
    assert object_name(b"model-x/block-00af", 0x1235) == name[:-1] + "5"  # another version, another file
    assert object_name(b"model-x/block-00ae", 0x1234) != name


def test_the_header_has_its_golden_bytes_and_reads_back():
    assert pack_header(GOLDEN) == GOLDEN_HEADER and HEADER_SIZE == 64
    assert GOLDEN_HEADER[56:64] == checksum(GOLDEN_HEADER[:56] + GOLDEN.key).to_bytes(8, "little")
    assert parse_header(GOLDEN_HEADER + b"hello") == GOLDEN  # what follows the key is not the header's
    assert parse_header(memoryview(GOLDEN_HEADER)) == GOLDEN


@pytest.mark.parametrize("damage, says", [
    (lambda h: b"KVPSHR02" + h[8:], "magic"),
    (lambda h: h[:20] + bytes([h[20] ^ 1]) + h[21:], "fails its check"),  # a flipped bit of the generation
    (lambda h: h[:-1] + b"g", "fails its check"),  # a flipped key byte
    (lambda h: h[:HEADER_SIZE - 1], "shorter than 64"),
    (lambda h: h[:-1], "shorter than the 82"),
    (lambda h: h[:8] + (MAX_KEY_BYTES + 1).to_bytes(2, "little") + h[10:], "key of 1025 bytes"),
])
def test_a_damaged_header_is_refused_saying_what_is_wrong(damage, says):
    with pytest.raises(ChecksumMismatchError, match=says):
        parse_header(damage(GOLDEN_HEADER))


def test_a_manifest_record_has_its_golden_bytes_and_reads_back():
    assert pack_record(ADDED, GOLDEN) == GOLDEN_RECORD
    removed = pack_record(REMOVED, GOLDEN)
    records = parse_records(GOLDEN_RECORD + removed)
    assert list(records) == [(ADDED, GOLDEN), (REMOVED, GOLDEN)]
    assert records.valid_bytes == 2 * len(GOLDEN_RECORD) and len(records) == 2 and records.keys == [GOLDEN.key] * 2


def test_records_stop_quietly_at_the_first_torn_or_damaged_frame():
    first, second, third = (pack_record(ADDED, GOLDEN._replace(generation=g)) for g in (1, 2, 3))
    for cut in (1, 11, 12, len(second) - 1):  # a writer that stopped anywhere in its last append
        records = parse_records(first + second[:cut])
        assert [obj.generation for _, obj in records] == [1] and records.valid_bytes == len(first)
    flipped = second[:30] + bytes([second[30] ^ 0x40]) + second[31:]  # a bit of its size: only the check tells
    records = parse_records(first + flipped + third)  # damaged in the middle: nothing after it counts
    assert [obj.generation for _, obj in records] == [1] and records.valid_bytes == len(first)
    bad_op = bytearray(pack_record(3, GOLDEN))
    records = parse_records(first + bytes(bad_op))  # a body that passes its check but names no op
    assert len(records) == 1 and records.valid_bytes == len(first)
    assert len(parse_records(b"")) == 0 and parse_records(b"").valid_bytes == 0


# -- writing and reading -----------------------------------------------------------------------------------

def test_objects_written_read_back_whole(shared):
    payloads = {b"a": b"x" * 1000, b"b/\xc3\xa9": bytes(range(256)) * 3, b"empty": b""}
    items = [(shared_object(key, 7, payload), payload) for key, payload in payloads.items()]
    sizes = shared.write_many([(obj, memoryview(payload)) for obj, payload in items])
    for (obj, payload), size in zip(items, sizes):
        path = shared.path(obj.key, obj.generation)
        assert size == HEADER_SIZE + len(obj.key) + len(payload) == os.path.getsize(path)
        assert shared.read(obj.key, 7) == (obj, payload)
        dest = np.zeros(len(payload), np.uint8)
        shared.read_into(obj.key, 7, size=obj.size, checksum=obj.checksum, dest=dest)
        assert dest.tobytes() == payload
    # Every file is in place under its name: no temporary file left behind.
    assert files_under(shared.objects_dir) == sorted(object_name(obj.key, 7) for obj, _ in items)
    assert shared.write(shared_object(b"a", 8, b"new"), b"new") == HEADER_SIZE + 1 + 3
    assert shared.read(b"a", 8)[1] == b"new" and shared.read(b"a", 7)[1] == payloads[b"a"]  # both versions kept


def test_a_payload_of_another_size_than_its_object_says_is_refused_before_any_io(shared):
    with pytest.raises(InvalidArgumentError, match="payload of 2 bytes"):
        shared.write_many([(shared_object(b"ok", 1, b"abc"), b"abc"), (shared_object(b"bad", 1, b"abc"), b"ab")])
    assert files_under(shared.objects_dir) == [] and shared.scan(NOW_MS).records == 0


def test_a_writer_killed_midway_leaves_only_a_temporary_file_no_read_sees(shared, tmp_path):
    # A process writing 300 KB killed at 100 KB (SIGXFSZ's default action, like a crash: no cleanup runs).
    killed = subprocess.run([sys.executable, "-c", f"""
import resource, signal
from kvpool.protocol.checksum import checksum
from kvpool.sharedfs.files import SharedDir
from kvpool.sharedfs.layout import SharedObject
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it (the write fails with EFBIG instead)
payload = b"p" * 300_000
shared = SharedDir({str(tmp_path)!r}, "cluster-a", "node-2-0")
shared.write(SharedObject(b"k", 3, len(payload), checksum(payload), 0, 0, 0), payload)  # 100 KB written, killed
with open(shared.path(b"k", 3), "rb"):  # never reached
    raise SystemExit(0)
"""], preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)), timeout=60)
    assert killed.returncode == -signal.SIGXFSZ
    path = shared.path(b"k", 3)
    left = os.listdir(os.path.dirname(path))
    assert len(left) == 1 and left[0].startswith(f".{os.path.basename(path)}.") and left[0].endswith(".tmp")
    assert os.path.getsize(os.path.join(os.path.dirname(path), left[0])) == 100_000
    with pytest.raises(KeyNotFoundError):
        shared.read(b"k", 3)
    assert shared.scan(NOW_MS).records == 0  # nothing recorded
    # A temporary file written by hand (another writer's, torn) is no more seen than that one.
    with open(os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.0123456789abcdef.tmp"), "wb") as f:
        f.write(pack_header(shared_object(b"k", 3, b"payload")) + b"pay")
    with pytest.raises(KeyNotFoundError):
        shared.read(b"k", 3)
    obj = shared_object(b"k", 3, b"payload")
    shared.write(obj, b"payload")
    assert shared.read(b"k", 3) == (obj, b"payload")


def damage_payload_byte(path, obj):
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + len(obj.key) + 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def damage_header_byte(path, obj):
    with open(path, "r+b") as f:
        f.seek(40)  # raw_size: only the header's own check can tell
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x80]))


def truncate(path, obj):
    os.truncate(path, os.path.getsize(path) - 1)


def another_keys_file(path, obj):
    other = shared_object(b"other", obj.generation, b"payload")  # same size and checksum, another key
    with open(path, "wb") as f:
        f.write(pack_header(other) + b"payload")


def another_generations_file(path, obj):
    other = obj._replace(generation=obj.generation + 1)
    with open(path, "wb") as f:
        f.write(pack_header(other) + b"payload")


@pytest.mark.parametrize("damage, says", [
    (damage_payload_byte, "payload fails its checksum"),
    (damage_header_byte, "header fails its check"),
    (truncate, "73 bytes; its header says 74"),
    (another_keys_file, "holds key b'other' generation 9, not b'key' generation 9"),
    (another_generations_file, "holds key b'key' generation 10, not b'key' generation 9"),
])
def test_a_damaged_or_misplaced_file_is_refused_naming_it(shared, damage, says):
    obj = shared_object(b"key", 9, b"payload")
    shared.write(obj, b"payload")
    path = shared.path(b"key", 9)
    damage(path, obj)
    with pytest.raises(ChecksumMismatchError, match=says) as refused:
        shared.read(b"key", 9)
    assert path in str(refused.value)
    dest = bytearray(7)
    with pytest.raises(ChecksumMismatchError, match=says):
        shared.read_into(b"key", 9, 7, obj.checksum, dest)


def test_a_missing_file_is_key_not_found(shared):
    with pytest.raises(KeyNotFoundError, match="generation 4"):
        shared.read(b"nothing", 4)
    with pytest.raises(KeyNotFoundError):
        shared.read_into(b"nothing", 4, 1, 0, bytearray(1))


def test_read_into_refuses_a_file_unlike_the_placement(shared):
    obj = shared_object(b"key", 2, b"payload")
    shared.write(obj, b"payload")
    with pytest.raises(ChecksumMismatchError, match="expected 7 of"):  # another version's checksum
        shared.read_into(b"key", 2, 7, obj.checksum ^ 1, bytearray(7))
    with pytest.raises(ChecksumMismatchError, match="holds 7 bytes .* expected 8"):
        shared.read_into(b"key", 2, 8, obj.checksum, bytearray(8))
    with pytest.raises(InvalidArgumentError, match="writable buffer of 7 bytes"):
        shared.read_into(b"key", 2, 7, obj.checksum, bytearray(6))
    with pytest.raises(InvalidArgumentError, match="read-only"):
        shared.read_into(b"key", 2, 7, obj.checksum, bytes(7))


def test_a_file_that_cannot_be_put_in_place_leaves_nothing_and_is_not_recorded(shared):
    good, bad = shared_object(b"good", 1, b"g"), shared_object(b"bad", 1, b"b")
    os.makedirs(shared.path(b"bad", 1))  # a directory where its file would go: the rename fails
    with pytest.raises(BatchError) as failed:
        shared.write_many([(good, b"g"), (bad, b"b")])
    assert failed.value.results[0] == HEADER_SIZE + 4 + 1 and isinstance(failed.value.results[1], UnavailableError)
    assert shared.path(b"bad", 1) in str(failed.value.results[1])
    assert not [name for name in files_under(shared.objects_dir) if name.endswith(".tmp")]
    assert [entry.key for entry in decode(shared.scan(NOW_MS).reply)] == ["good"]
    with pytest.raises(UnavailableError):  # one object's write raises its own error
        shared.write(bad, b"b")


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past `limit` bytes of any file fail (EFBIG) while inside, as a full file system's would."""
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the error, not the signal's default (a kill)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)


def test_a_write_that_fails_midway_leaves_no_file_under_the_name_nor_a_temporary_one(shared):
    small, large = shared_object(b"small", 1, b"s" * 100), shared_object(b"large", 1, b"L" * 300_000)
    with file_size_limit(100_000), pytest.raises(BatchError) as failed:
        shared.write_many([(large, b"L" * 300_000), (small, b"s" * 100)])
    assert isinstance(failed.value.results[0], UnavailableError) and "File too large" in str(failed.value.results[0])
    assert files_under(shared.objects_dir) == [object_name(b"small", 1)]
    with pytest.raises(KeyNotFoundError):
        shared.read(b"large", 1)
    assert [entry.key for entry in decode(shared.scan(NOW_MS).reply)] == ["small"]


def test_a_removal_that_cannot_be_recorded_removes_nothing(shared):
    obj = shared_object(b"k", 1, b"v")
    shared.write(obj, b"v")
    # Room for part of the record: the append is torn, then cut back.
    with file_size_limit(os.path.getsize(shared.manifest_path) + 10), pytest.raises(UnavailableError):
        shared.remove(b"k", 1)
    assert shared.read(b"k", 1) == (obj, b"v")  # the file stays while its record says ADDED
    assert os.path.getsize(shared.manifest_path) == len(pack_record(ADDED, obj))  # no torn record left behind
    assert shared.remove(b"k", 1) is True and decode(shared.scan(NOW_MS).reply) == []


# -- removing ----------------------------------------------------------------------------------------------

def test_removing_a_file_a_reader_has_open_leaves_that_reader_the_whole_file(shared):
    payload = os.urandom(300_000)
    obj = shared_object(b"busy", 5, payload)
    shared.write(obj, payload)
    with open(shared.path(b"busy", 5), "rb") as reader:
        first = reader.read(1000)
        assert shared.remove_many([obj, (b"never-written", 1)]) == [True, False]
        rest = reader.read()
    assert parse_header(first) == obj and (first + rest)[HEADER_SIZE + 4:] == payload
    with pytest.raises(KeyNotFoundError):
        shared.read(b"busy", 5)
    assert shared.remove(b"busy", 5) is False


# -- the scan ------------------------------------------------------------------------------------------------

def test_the_scan_folds_every_writers_manifest(tmp_path):
    one = SharedDir(str(tmp_path), "cluster-a", "node-1-0")
    two = SharedDir(str(tmp_path), "cluster-a", "node-2-0")
    one.write_many([(shared_object(b"kept", 1, b"v1"), b"v1"), (shared_object(b"kept", 2, b"v2"), b"v2"),
                    (shared_object(b"gone", 1, b"g"), b"g"), (shared_object(b"ttl", 1, b"t", NOW_MS + 5000), b"t"),
                    (shared_object(b"late", 1, b"l", NOW_MS), b"l")])
    two.write(shared_object(b"kept", 3, b"v3"), b"v3")
    two.write(shared_object(b"ttl", 1, b"t", NOW_MS + 5000), b"t")  # two writers of one version: one object
    two.write(shared_object(b"newest-gone", 9, b"n"), b"n")
    two.remove(b"gone", 1)  # a file another writer added
    one.remove(b"newest-gone", 9)
    two.write(shared_object(b"newest-gone", 8, b"o"), b"o")  # an older generation, live: it is the key's object
    one.write(shared_object(b"again", 4, b"a"), b"a")
    one.remove(b"again", 4)
    one.write(shared_object(b"again", 4, b"b", NOW_MS + 1), b"b")  # one writer's own order counts: its last word
    with open(two.manifest_path, "ab") as f:  # two's last append torn by a crash
        f.write(pack_record(ADDED, shared_object(b"torn", 1, b"x"))[:-3])

    scan = one.scan(NOW_MS)
    entries = {entry.key: entry for entry in decode(scan.reply)}
    assert entries == {
        "kept": Entry("kept", 3, 2, checksum(b"v3"), 1, 4, 0, SHARED_BIT),
        "ttl": Entry("ttl", 1, 1, checksum(b"t"), 1, 2, 5000, SHARED_BIT),
        "newest-gone": Entry("newest-gone", 8, 1, checksum(b"o"), 1, 2, 0, SHARED_BIT),
        "again": Entry("again", 4, 1, checksum(b"b"), 1, 2, 1, SHARED_BIT),
    }
    assert sorted(scan.superseded) == [shared_object(b"kept", 1, b"v1"), shared_object(b"kept", 2, b"v2")]
    assert scan.expired == [shared_object(b"late", 1, b"l", NOW_MS)]
    assert (scan.records, scan.manifests) == (5 + 2 + 1 + 1 + 1 + 1 + 3, 2)  # the torn record is not counted
    assert scan.bytes == sum(HEADER_SIZE + len(key) + entry.size for key, entry in
                             ((k.encode(), e) for k, e in entries.items()))
    one.close()
    two.close()


def test_a_writer_cuts_a_torn_manifest_before_appending_to_it(tmp_path):
    with SharedDir(str(tmp_path), "c", "node-1-0") as first:
        first.write(shared_object(b"a", 1, b"a"), b"a")
        manifest = first.manifest_path
    whole = os.path.getsize(manifest)
    with open(manifest, "ab") as f:  # the process died mid-append
        f.write(pack_record(ADDED, shared_object(b"torn", 1, b"x"))[:20])
    with SharedDir(str(tmp_path), "c", "node-1-0") as again:  # the same writer name, restarted
        again.write(shared_object(b"b", 1, b"b"), b"b")  # without the cut it would sit behind the torn record
        assert [entry.key for entry in decode(again.scan(NOW_MS).reply)] == ["a", "b"]
    assert os.path.getsize(manifest) == whole + len(pack_record(ADDED, shared_object(b"b", 1, b"b")))


def test_an_empty_tier_scans_to_an_empty_reply(shared):
    scan = shared.scan(NOW_MS)
    assert decode(scan.reply) == [] and (scan.records, scan.manifests, scan.bytes) == (0, 0, 0)


def test_directories_and_files_get_their_modes_whatever_the_umask(tmp_path):
    old = os.umask(0o077)
    try:
        with SharedDir(str(tmp_path), "cluster-a", "node-1-0") as shared:
            shared.write(shared_object(b"k", 1, b"v"), b"v")
            path = shared.path(b"k", 1)
    finally:
        os.umask(old)
    base = tmp_path / "cluster-a"
    directories = [base, base / "objects", base / "manifests", os.path.dirname(os.path.dirname(path)),
                   os.path.dirname(path)]
    assert [stat.S_IMODE(os.stat(d).st_mode) for d in directories] == [0o750] * 5
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(base / "manifests" / "node-1-0.log").st_mode) == 0o640


@pytest.mark.parametrize("cluster, writer", [("a/b", "w"), ("c", ""), ("c", ".hidden"), ("..", "w")])
def test_names_that_are_not_one_plain_file_name_are_refused(tmp_path, cluster, writer):
    with pytest.raises(InvalidArgumentError):
        SharedDir(str(tmp_path), cluster, writer)


def test_a_readers_view_creates_nothing_reads_and_refuses_to_write(shared, tmp_path):
    payload = b"r" * 100
    obj = shared_object(b"read-me", 3, payload)
    shared.write(obj, payload)
    with pytest.raises(FileNotFoundError):  # a reader of a directory not mounted makes none
        os.stat(tmp_path / "elsewhere" / "cluster-a")
    SharedDir.reader(str(tmp_path / "elsewhere"), "cluster-a")
    assert not (tmp_path / "elsewhere").exists()
    reader = SharedDir.reader(str(tmp_path), "cluster-a")
    dest = bytearray(len(payload))
    reader.read_into(b"read-me", 3, obj.size, obj.checksum, dest)
    assert bytes(dest) == payload
    manifests = sorted(os.listdir(shared.manifests_dir))
    with pytest.raises(InvalidArgumentError):
        reader.write(shared_object(b"other", 4, payload), payload)
    with pytest.raises(InvalidArgumentError):
        reader.remove(b"read-me", 3)
    assert sorted(os.listdir(shared.manifests_dir)) == manifests
    assert files_under(shared.objects_dir) == [object_name(b"read-me", 3)]
