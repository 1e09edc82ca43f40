"""The node's DRAM segment: one mapping of the configured size, made once at start."""

import logging
import mmap
import os

from .tier import Tier

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"


def segment_name(cluster: str, node_id: str, instance: str) -> str:
    return f"kvpool-{cluster}-{node_id}-{instance}"


class DramSegment(Tier):
    """Shared-memory file mapped read/write (so a same-host process could map it too).

    The file's pages are reserved with posix_fallocate up front: a sparse tmpfs file
    that later runs out of room would kill the node with SIGBUS on a write. When
    /dev/shm is missing or too small the segment falls back to an anonymous mapping.
    """

    name = "dram"

    def __init__(self, capacity: int, file_name: str, directory: str = SHM_DIR):
        if capacity <= 0:
            raise ValueError(f"DRAM segment size must be positive, got {capacity}")
        self.capacity = capacity
        self.path = ""
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
            os.posix_fallocate(fd, 0, self.capacity)
            mapping = mmap.mmap(fd, self.capacity)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        self.path = path
        return mapping

    def _slice(self, offset: int, length: int) -> memoryview:
        return self._buf[offset:offset + length]

    def close(self) -> None:
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        try:
            self._buf.release()
            self._mmap.close()
        except BufferError:
            # A view is still referenced somewhere; the mapping goes away with the process.
            log.warning("DRAM segment still in use at close; leaving it mapped")
