"""The copy-engine interface: what the device pipeline (transfers.py) needs of a kind of device memory.

An engine knows its memory (which objects are its, their bytes as a flat region), page-locked host memory for
staging, and two queues of work: the caller's stream (where the engine that owns the memory runs its kernels)
and the engine's own copy stream, where every copy of the pipeline runs. Copies are asynchronous: enqueued,
then waited for through events recorded after them. The caller's stream is ordered against the copy stream
only device-side (`copy_after_caller`, `caller_after`): the pipeline never makes the host wait for the
caller's stream, which would stall whatever else the engine has queued there.

cuda.py implements it with torch's CUDA streams and events; cpu.py with threads over host memory, so that
every step of the pipeline runs and is tested on machines without a GPU.
"""

from abc import ABC, abstractmethod


class Region(ABC):
    """A flat, contiguous range of device memory, `nbytes` long."""

    nbytes: int

    @abstractmethod
    def slice(self, offset: int, size: int) -> "Region":
        """The bytes [offset, offset + size) of this region."""


class CopyEngine(ABC):
    name: str  # what bytes_by_transport() calls its transfers: "<name>:staged", "<name>:direct"

    @abstractmethod
    def claims(self, obj) -> bool:
        """Whether `obj` is memory of this engine (a torch CUDA tensor, a CuPy array, ...)."""

    @abstractmethod
    def region(self, obj, what: str, writable: bool) -> Region:
        """`obj`'s bytes as a region; InvalidArgumentError when it is not contiguous (as for host buffers)."""

    @abstractmethod
    def pinned(self, nbytes: int) -> memoryview:
        """`nbytes` of page-locked host memory, which copies to and from the device reach by DMA."""

    @abstractmethod
    def register_host(self, view: memoryview) -> bool:
        """Make the host mapping `view` lies in reachable by DMA (once per mapping: the whole of view.obj);
        False where it cannot be, and copies to or from it go through staging instead."""

    @abstractmethod
    def to_host(self, source: Region, dest: memoryview) -> None:
        """Enqueue a copy of `source` into host memory `dest` (same length) on the copy stream."""

    @abstractmethod
    def to_device(self, source: memoryview, dest: Region) -> None:
        """Enqueue a copy of host memory `source` into `dest` (same length) on the copy stream."""

    @abstractmethod
    def record(self):
        """An event on the copy stream: done once everything enqueued there before it is."""

    @abstractmethod
    def copy_after_caller(self) -> None:
        """Copies enqueued from now on wait for the work the caller's stream holds now (the kernels that
        wrote a value being saved), device-side."""

    @abstractmethod
    def caller_after(self, event) -> None:
        """Work the caller enqueues on its stream from now on waits for `event` (a load's last copy),
        device-side."""

    @abstractmethod
    def done(self, event) -> bool:
        """Whether `event` completed (DeviceCopyError if a copy before it failed)."""

    @abstractmethod
    def wait(self, event) -> None:
        """Block this thread until copy-stream `event` completed; DeviceCopyError if a copy before it failed."""
