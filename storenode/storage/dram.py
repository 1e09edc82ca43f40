"""The node's DRAM segment: one mapping of the configured size, made once at start."""

import fcntl
import glob
import logging
import mmap
import os
import re

from kvpool.storenode.storage.prefault import prefault

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
_INSTANCE = re.compile(r"^[0-9a-f]{32}$")


def segment_name(cluster: str, node_id: str, instance: str) -> str:
    return f"kvpool-{cluster}-{node_id}-{instance}"


def remove_stale_segments(cluster: str, node_id: str, directory: str = SHM_DIR) -> list[str]:
    """Unlink segments an earlier, killed run of this node left behind; returns their paths.

    A running node holds a lock on its segment file, so a file we can lock has
    no owner left, whichever node's name it matches.
    """
    removed = []
    prefix = segment_name(cluster, node_id, "")
    for path in glob.glob(os.path.join(glob.escape(directory), glob.escape(prefix) + "*")):
        if not _INSTANCE.match(os.path.basename(path)[len(prefix):]):  # e.g. node "n1-x" when we are "n1"
            continue
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass  # locked: its node is alive
        finally:
            os.close(fd)
    return removed


class DramSegment:
    """Shared-memory file mapped read/write (so a same-host process could map it too).

    The file's pages are reserved with posix_fallocate up front: a sparse tmpfs file
    that later runs out of room would kill the node with SIGBUS on a write. When
    /dev/shm is missing or too small the segment falls back to an anonymous mapping.
    """

    name = "dram"
    alignment = 64  # cache lines

    def __init__(self, capacity: int, file_name: str, directory: str = SHM_DIR):
        if capacity <= 0:
            raise ValueError(f"DRAM segment size must be positive, got {capacity}")
        self.capacity = capacity
        self.path = ""
        self._fd = -1
        try:
            self._mmap = self._map_file(os.path.join(directory, file_name))
        except OSError as exc:
            log.warning("cannot back the DRAM segment with a file in %s (%s); using anonymous memory",
                        directory, exc)
            self._mmap = mmap.mmap(-1, capacity)
        self._buf = memoryview(self._mmap)

    def _map_file(self, path: str) -> mmap.mmap:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while we live: see remove_stale_segments
            os.posix_fallocate(fd, 0, self.capacity)
            mapping = mmap.mmap(fd, self.capacity)
            prefault(mapping)  # first writes into fresh extents would fault page by page
        except BaseException:
            os.unlink(path)
            os.close(fd)
            raise
        self._fd = fd
        self.path = path
        return mapping

    @staticmethod
    def extent_length(_key_len: int, size: int) -> int:
        return size

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of [offset, offset+length) (the caller got the extent from its allocator)."""
        if offset < 0 or length < 0 or offset + length > self.capacity:
            raise ValueError(f"extent [{offset}, {offset + length}) is outside the {self.capacity}-byte segment")
        return self._buf[offset:offset + length]

    def close(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._buf.release()
            self._mmap.close()
        except BufferError:
            # A view is still referenced somewhere; the mapping goes away with the process.
            log.warning("DRAM segment still in use at close; leaving it mapped")
