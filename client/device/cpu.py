"""A copy engine over host memory: the device pipeline, run and tested where no GPU is.

Its "device memory" is DeviceBuffer, which offers no buffer protocol, so the only way bytes reach it or leave
it is through the engine's copies, as with GPU memory. Its two streams are worker threads that run their work
in order: the caller's stream (`launch` puts a "kernel" there, e.g. one writing a buffer slowly) and the copy
stream. Events are futures on a stream; a stream waiting for another's event blocks its own thread only, so
ordering is device-side as on a GPU. It counts what a test must see: the copies it ran (and how large) and the
host mappings registered; and it can fail a chosen copy or slow every copy down.
"""

import concurrent.futures
import threading
import time

import numpy

from kvpool.errors import DeviceCopyError, InvalidArgumentError

from .engine import CopyEngine, Region


class DeviceBuffer:
    """`nbytes` of this engine's memory (no buffer protocol: read and written only by its copies)."""

    def __init__(self, engine: "CpuCopyEngine", nbytes: int):
        self.engine = engine
        self._bytes = numpy.zeros(nbytes, numpy.uint8)
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def fill(self, data) -> None:
        """Write `data` into the buffer now (a host-side write, for setting up a test)."""
        self._bytes[:len(data)] = numpy.frombuffer(data, numpy.uint8)

    def read(self) -> bytes:
        """The buffer's bytes once both streams are idle (for checking a test)."""
        self.engine.settle()
        return self._bytes.tobytes()


class _Region(Region):
    def __init__(self, array: numpy.ndarray):
        self.array = array
        self.nbytes = len(array)

    def slice(self, offset: int, size: int) -> "_Region":
        return _Region(self.array[offset:offset + size])


class _Stream:
    """Work run in order by one thread; a failed copy fails the next event recorded after it."""

    def __init__(self, name: str):
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        self.failure: Exception | None = None

    def submit(self, work) -> concurrent.futures.Future:
        return self.thread.submit(work)

    def record(self) -> concurrent.futures.Future:
        def event():
            failure, self.failure = self.failure, None
            if failure is not None:
                raise failure
        return self.thread.submit(event)


class CpuCopyEngine(CopyEngine):
    """copy_delay: seconds each copy takes at least. fail_copy: the index (0-based, counted over this
    engine's life) of the copy that fails with DeviceCopyError."""

    name = "cpu-device"

    def __init__(self, copy_delay: float = 0.0, fail_copy: int | None = None):
        self.copy_delay = copy_delay
        self.fail_copy = fail_copy
        self.caller = _Stream("kvpool-test-caller-stream")
        self.copies = _Stream("kvpool-test-copy-stream")
        self._lock = threading.Lock()
        self.copied: list[tuple[str, int]] = []  # ("to_host" | "to_device", bytes) per copy, in order run
        self.pinned_bytes = 0
        self.registered: set[int] = set()  # id() of host mappings made reachable

    def buffer(self, data_or_size) -> DeviceBuffer:
        """A new DeviceBuffer: of `data_or_size` bytes, or holding a copy of the bytes given."""
        if isinstance(data_or_size, int):
            return DeviceBuffer(self, data_or_size)
        buffer = DeviceBuffer(self, len(data_or_size))
        buffer.fill(data_or_size)
        return buffer

    def launch(self, kernel) -> None:
        """Run kernel() on the caller's stream, after everything launched there before."""
        self.caller.submit(kernel)

    def settle(self) -> None:
        """Wait until both streams ran everything enqueued so far (a test's check, not the pipeline's)."""
        self.caller.submit(lambda: None).result()
        self.copies.submit(lambda: None).result()

    def claims(self, obj) -> bool:
        return isinstance(obj, DeviceBuffer) and obj.engine is self

    def region(self, obj, what: str, writable: bool) -> Region:
        if not self.claims(obj):
            raise InvalidArgumentError(f"{what} of type {type(obj).__name__} is not this engine's memory")
        return _Region(obj._bytes)

    def pinned(self, nbytes: int) -> memoryview:
        self.pinned_bytes += nbytes
        return memoryview(bytearray(nbytes))

    def register_host(self, view: memoryview) -> bool:
        self.registered.add(id(view.obj))
        return True

    def _copy(self, direction: str, nbytes: int, run) -> None:
        def copy():
            with self._lock:
                index = len(self.copied)
                self.copied.append((direction, nbytes))
            if self.copy_delay:
                time.sleep(self.copy_delay)
            if index == self.fail_copy:
                self.copies.failure = DeviceCopyError(f"copy {index} failed ({direction}, {nbytes} bytes)")
                return
            run()
        self.copies.submit(copy)

    def to_host(self, source: _Region, dest: memoryview) -> None:
        if source.nbytes != len(dest):
            raise InvalidArgumentError(f"copy of {source.nbytes} device bytes into {len(dest)} host bytes")
        self._copy("to_host", len(dest), lambda: numpy.copyto(numpy.frombuffer(dest, numpy.uint8), source.array))

    def to_device(self, source: memoryview, dest: _Region) -> None:
        if dest.nbytes != len(source):
            raise InvalidArgumentError(f"copy of {len(source)} host bytes into {dest.nbytes} device bytes")
        self._copy("to_device", len(source),
                   lambda: numpy.copyto(dest.array, numpy.frombuffer(source, numpy.uint8)))

    def record(self):
        return self.copies.record()

    def copy_after_caller(self) -> None:
        marker = self.caller.submit(lambda: None)
        self.copies.submit(marker.result)  # the copy thread waits; the host does not

    def caller_after(self, event) -> None:
        self.caller.submit(lambda: concurrent.futures.wait([event]))

    def done(self, event) -> bool:
        if not event.done():
            return False
        event.result()  # raises the failed copy's error
        return True

    def wait(self, event) -> None:
        if event is None:
            return
        event.result()
