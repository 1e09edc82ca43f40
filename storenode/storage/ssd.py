"""The node's SSD segment: one preallocated file whose extents describe themselves.

Extent layout: HEADER | key | payload. The key and payload are written first
and the header last, so a crash mid-write leaves no header and the extent is
simply free after a restart; a freed extent gets its header zeroed so it is
never mistaken for a live object. The header carries its own check (over its
fields and the key) and the payload checksum, so recovery can tell a torn or
damaged extent from a whole one. The header check is an HMAC under a key kept
next to the segment file (HEADER_KEY_FILE, mode 0600), so bytes a client
stored (say, a crafted image of a header, left on disk once the object
holding them is freed) never pass for an object at a restart.

Writes go to the page cache (no fsync per object): a killed node keeps
everything it acknowledged; a power loss may lose recent objects, which
recovery then discards by their checksums.
"""

import errno
import fcntl
import hashlib
import hmac
import logging
import secrets
import os
import struct
from typing import NamedTuple

from kvpool.protocol.checksum import Digest
from kvpool.errors import UnavailableError
from kvpool.protocol.keys import MAX_KEY_BYTES

log = logging.getLogger(__name__)

SEGMENT_FILE = "segment.kv"
ALIGNMENT = 4096  # extents start on page boundaries, which is also where recovery looks for headers
MAGIC = b"KVPOOLx2"  # x2: the header check is keyed
HEADER_KEY_FILE = "header.key"
# magic, key_len, flags, reserved, generation, size, checksum, raw_size, expires_ms, header_check
HEADER = struct.Struct("<8sHHIQQQQQQ")
_CHECKED = HEADER.size - 8  # the header check covers everything before it, and the key
_FREED = bytes(HEADER.size)
IO_CHUNK = 1024 * 1024


class StoredObject(NamedTuple):
    key: bytes
    generation: int
    size: int
    checksum: int
    flags: int
    raw_size: int
    expires_ms: int  # unix ms; 0 = no TTL


def _header_key(directory: str) -> bytes:
    """This segment's header key: made on first use, kept beside the segment file."""
    path = os.path.join(directory, HEADER_KEY_FILE)
    try:
        with open(path, "rb") as f:
            key = f.read()
        if len(key) == 32:
            return key
        log.warning("%s is damaged: a new header key is made, and objects kept before are not recovered", path)
    except FileNotFoundError:
        pass
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    return key


class SsdSegment:
    name = "ssd"
    alignment = ALIGNMENT

    def __init__(self, directory: str, capacity: int):
        if capacity <= 0:
            raise ValueError(f"SSD segment size must be positive, got {capacity}")
        os.makedirs(directory, exist_ok=True)
        self.capacity = capacity
        self.directory = directory
        self.path = os.path.join(directory, SEGMENT_FILE)
        # Told of an I/O error that says the disk fails (kvpool/sharedfs/file_gate.py fault_of); the tier then
        # takes no new objects until its probe answers (storenode/storage/tiers.py).
        self.on_fault = None
        self._key = _header_key(directory)
        # Unbuffered binary file object (SSD READs send from its descriptor); all I/O is positional.
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.file = open(self.fd, "r+b", buffering=0)  # noqa: SIM115 (lives as long as the node)
        try:
            # Two nodes on one data dir would overwrite each other's extents.
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            self.file.close()
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise UnavailableError(f"{self.path} is in use by another running node") from None
            raise
        try:
            if os.fstat(self.fd).st_size > capacity:
                os.ftruncate(self.fd, capacity)
            # Reserve the blocks now so a full disk fails at start, not in the middle of a WRITE.
            os.posix_fallocate(self.fd, 0, capacity)
        except OSError as exc:
            self.file.close()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
                raise ValueError(f"the SSD segment ({capacity} bytes) does not fit in {directory}, which has "
                                 f"{free} bytes free: give --ssd a smaller size, or --ssd-dir a larger disk") from None
            raise
        except BaseException:
            self.file.close()
            raise

    @staticmethod
    def extent_length(key_len: int, size: int) -> int:
        return HEADER.size + key_len + size

    @staticmethod
    def key_offset(offset: int) -> int:
        return offset + HEADER.size

    @staticmethod
    def payload_offset(offset: int, key_len: int) -> int:
        return offset + HEADER.size + key_len

    # -- raw I/O (may block on a busy disk: callers on the event loop keep these small)

    def pwrite_all(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        try:
            while view:
                written = os.pwrite(self.fd, view, offset)
                view, offset = view[written:], offset + written
        except OSError as exc:
            self.noticed(exc)
            raise

    def pread_into(self, buffer, offset: int) -> None:
        view = memoryview(buffer).cast("B")
        try:
            while view:
                got = os.preadv(self.fd, [view], offset)
                if not got:
                    raise OSError(errno.EIO, f"{self.path}: short read at {offset}")
                view, offset = view[got:], offset + got
        except OSError as exc:
            self.noticed(exc)
            raise

    def noticed(self, exc: OSError) -> None:
        if self.on_fault is not None:
            self.on_fault(exc)

    def probe(self) -> None:
        """A write, fsync and read of a page beside the segment, and a read of the segment's first page: raises
        while the disk fails (its file gate's probe)."""
        path = os.path.join(self.directory, "probe")
        page = secrets.token_bytes(ALIGNMENT)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.pwrite(fd, page, 0)
            os.fsync(fd)
            if os.pread(fd, ALIGNMENT, 0) != page:
                raise OSError(errno.EIO, f"{path} read back other bytes")
        finally:
            os.close(fd)
        os.unlink(path)
        os.pread(self.fd, ALIGNMENT, 0)

    # -- extents

    def write_object(self, offset: int, obj: StoredObject, payload) -> None:
        """Key and payload, then the header that makes them an object (a blocking call: run it in a thread)."""
        self.write_body(offset, obj.key, payload)
        self.write_header(offset, obj)

    def write_body(self, offset: int, key: bytes, payload) -> None:
        """An object's key and payload, not yet an object: its header comes after (a blocking call)."""
        self.pwrite_all(key, self.key_offset(offset))
        self.pwrite_all(payload, self.payload_offset(offset, len(key)))

    def pack_header(self, obj: StoredObject) -> bytes:
        head = HEADER.pack(MAGIC, len(obj.key), obj.flags, 0, obj.generation, obj.size, obj.checksum,
                           obj.raw_size, obj.expires_ms, 0)[:_CHECKED]
        return head + self._check(head, obj.key)

    def _check(self, head: bytes, key: bytes) -> bytes:
        return hmac.new(self._key, head + key, hashlib.sha256).digest()[:8]

    def write_header(self, offset: int, obj: StoredObject) -> None:
        self.pwrite_all(self.pack_header(obj), offset)

    def clear_header(self, offset: int) -> None:
        self.pwrite_all(_FREED, offset)

    def read_header(self, offset: int) -> StoredObject | None:
        """The object whose header is at `offset`, or None if there is no intact header there."""
        try:
            raw = os.pread(self.fd, HEADER.size, offset)
        except OSError as exc:
            self.noticed(exc)
            raise
        if len(raw) < HEADER.size:
            return None
        magic, key_len, flags, _, generation, size, value_checksum, raw_size, expires_ms, _check = \
            HEADER.unpack(raw)
        if magic != MAGIC or key_len > MAX_KEY_BYTES or size == 0 \
                or offset + self.extent_length(key_len, size) > self.capacity:
            return None
        key = os.pread(self.fd, key_len, offset + HEADER.size)
        if len(key) != key_len or not hmac.compare_digest(raw[_CHECKED:], self._check(raw[:_CHECKED], key)):
            return None
        return StoredObject(key, generation, size, value_checksum, flags, raw_size, expires_ms)

    def payload_intact(self, offset: int, obj: StoredObject, buffer: bytearray) -> bool:
        """Whether the payload hashes to the header's checksum (reads it through `buffer`)."""
        view = memoryview(buffer)
        digest = Digest()
        position, left = self.payload_offset(offset, len(obj.key)), obj.size
        while left:
            piece = view[:min(left, len(view))]
            self.pread_into(piece, position)
            digest.update(piece)
            position += len(piece)
            left -= len(piece)
        return digest.intdigest() == obj.checksum

    def close(self) -> None:
        try:
            self.file.close()  # also releases the lock
        except OSError as exc:  # a failing disk: the descriptor is gone all the same
            log.warning("closing %s: %s", self.path, exc)
