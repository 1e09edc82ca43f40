"""What an SSD segment's scan at start believes (storenode/storage/recovery.py scan), on a real segment file."""

import os

from kvpool.protocol.checksum import checksum
from kvpool.storenode.storage.recovery import scan
from kvpool.storenode.storage.ssd import ALIGNMENT, HEADER_KEY_FILE, SsdSegment, StoredObject

MiB = 1 << 20


def stored(key: bytes, payload: bytes) -> StoredObject:
    return StoredObject(key, 7, len(payload), checksum(payload), 0, len(payload), 0)


def found(segment: SsdSegment) -> dict:
    return {obj.key: verdict for _at, obj, verdict in scan(segment, now_ms=0)}


def test_a_torn_header_claiming_much_does_not_hide_what_follows(tmp_path):
    segment = SsdSegment(str(tmp_path), 8 * MiB)
    big = os.urandom(3 * MiB)
    segment.write_object(0, stored(b"big", big), big)
    # The space inside big's extent is reused (big's header was never cleared: a crash in between).
    small = os.urandom(10_000)
    segment.write_object(16 * ALIGNMENT, stored(b"small", small), small)
    assert found(segment) == {b"big": "torn", b"small": "ok"}


def test_a_freed_object_and_header_images_inside_values_are_never_revived(tmp_path):
    directory = str(tmp_path / "node")
    segment = SsdSegment(directory, 4 * MiB)
    # A client stores bytes that are a well-formed extent, made with a key other than this node's.
    impostor = SsdSegment(str(tmp_path / "other"), 1 * MiB)
    forged_payload = b"evil" * 1000
    image = impostor.pack_header(stored(b"forged", forged_payload)) + b"forged" + forged_payload
    carrier = os.urandom(ALIGNMENT - 100) + bytes(100) + image + os.urandom(5000)
    carrier = carrier[:ALIGNMENT] + image + carrier[ALIGNMENT + len(image):]  # the image on a boundary
    segment.write_object(0, stored(b"carrier", carrier), carrier)
    removed = os.urandom(20_000)
    segment.write_object(64 * ALIGNMENT, stored(b"removed", removed), removed)
    segment.clear_header(0)  # both freed, as the store does before reusing an extent
    segment.clear_header(64 * ALIGNMENT)
    segment.close()
    again = SsdSegment(directory, 4 * MiB)  # a restart: the same key file
    assert found(again) == {}
    assert oct(os.stat(os.path.join(directory, HEADER_KEY_FILE)).st_mode & 0o777) == "0o600"


def test_headers_hold_across_a_restart_and_only_with_their_key(tmp_path):
    directory = str(tmp_path)
    segment = SsdSegment(directory, 2 * MiB)
    value = os.urandom(50_000)
    segment.write_object(0, stored(b"kept", value), value)
    segment.close()
    assert found(SsdSegment(directory, 2 * MiB)) == {b"kept": "ok"}
    os.remove(os.path.join(directory, HEADER_KEY_FILE))  # a lost key: nothing can be trusted
    assert found(SsdSegment(directory, 2 * MiB)) == {}
