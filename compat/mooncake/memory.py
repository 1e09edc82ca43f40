"""Raw addresses, as Mooncake's zero-copy calls take them, turned into memoryviews: only inside a range the caller
registered (register_buffer, or memory this module allocated), so an address never registered is refused and
never read or written. Mooncake over TCP accepts any address; a wrong one there corrupts memory silently."""

import bisect
import ctypes
import mmap
import threading


class UnregisteredMemory(ValueError):
    """An address range that lies in no registered buffer."""


class RegisteredMemory:
    """The buffers a store may read from and write into, by start address."""

    def __init__(self):
        self._starts: list[int] = []  # sorted
        self._views: dict[int, memoryview] = {}  # start -> a writable view of the whole buffer
        self._lock = threading.Lock()  # registering may race with transfers on other threads

    def register(self, address: int, size: int) -> memoryview:
        if not _is_count(address) or address == 0 or not _is_count(size) or size == 0:
            raise UnregisteredMemory(f"register_buffer needs an address and a size above 0, got {address!r}, "
                                     f"{size!r}")
        view = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
        with self._lock:
            if address not in self._views:
                bisect.insort(self._starts, address)
            self._views[address] = view  # registering a start again: its newer size counts
        return view

    def unregister(self, address: int) -> bool:
        with self._lock:
            view = self._views.pop(address, None)
            if view is None:
                return False
            self._starts.remove(address)
        return True

    def view(self, address: int, size: int) -> memoryview:
        """The bytes [address, address + size) as a view, when one registered buffer holds them all."""
        if not _is_count(address) or not _is_count(size):
            raise UnregisteredMemory(f"an address and a size must be integers >= 0, got {address!r}, {size!r}")
        starts = self._starts
        i = bisect.bisect_right(starts, address)
        while i:  # buffers starting at or below the address, nearest first (they may overlap)
            i -= 1
            start = starts[i]
            whole = self._views.get(start)
            if whole is not None and address + size <= start + len(whole):
                return whole[address - start:address - start + size]
        raise UnregisteredMemory(f"{size} bytes at {address:#x} are not inside a registered buffer: call "
                                 "register_buffer(address, size) for the memory first")

    def clear(self) -> None:
        with self._lock:
            self._starts.clear()
            self._views.clear()


def _is_count(value) -> bool:
    return type(value) is int and value >= 0


class MooncakeHostMemAllocator:
    """Mooncake's host memory allocator (SGLang's standalone mode allocates its host KV pool with it): anonymous
    mappings, registered with every store of this process as they are made, so zero-copy calls may use them."""

    def __init__(self):
        self._maps: dict[int, mmap.mmap] = {}

    def alloc(self, size: int) -> int:
        if not _is_count(size) or size == 0:
            return 0
        region = mmap.mmap(-1, size)
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        self._maps[address] = region
        ALLOCATED.register(address, size)
        return address

    def free(self, address: int) -> int:
        region = self._maps.pop(address, None)
        if region is None:
            return -1
        ALLOCATED.unregister(address)
        try:
            region.close()
        except BufferError:  # a view of it is still alive: the mapping goes with the last one
            pass
        return 0


ALLOCATED = RegisteredMemory()  # what MooncakeHostMemAllocator handed out, usable by every store
