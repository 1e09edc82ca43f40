"""Map every page of a shared mapping up front, so transfers do not pay page faults.

A first touch of each 4 KiB page of a /dev/shm mapping costs a fault (about
2 ms per 4 MiB on the VMs measured, several times the copy itself), once per
process. madvise(MADV_POPULATE_WRITE) (Linux 5.14+) maps them all in one call;
on older kernels it fails and pages fault in as before.
"""

import ctypes
import logging
import mmap

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def prefault(mapping: mmap.mmap) -> bool:
    """Map every page of `mapping` now; False if the kernel cannot."""
    window = ctypes.c_char.from_buffer(mapping)  # an export: the mapping cannot close meanwhile
    try:
        if _libc.madvise(ctypes.addressof(window), len(mapping), _MADV_POPULATE_WRITE) != 0:
            log.debug("madvise(MADV_POPULATE_WRITE) failed: errno %d", ctypes.get_errno())
            return False
        return True
    finally:
        del window
