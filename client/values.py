"""Values and destination buffers as flat byte memoryviews, without copying.

Accepts anything with the buffer protocol (bytes, bytearray, memoryview,
numpy arrays, array.array, mmap) and torch CPU tensors. A strided value would
need a copy to become one contiguous extent, so it is refused instead. Device memory (CUDA tensors) is taken
before it gets here, by client/device/transfers.py.
"""

import ctypes
import sys

from kvpool.protocol.checksum import Digest, checksum
from kvpool.errors import InvalidArgumentError
from kvpool.protocol.parts import Parts

# get() returns bytes. Receiving into a bytearray and copying it out costs a zero-fill
# and a full copy (1.6 ms for 4 MiB here); instead the bytes object is created
# uninitialised, as C code does with PyBytes_FromStringAndSize(NULL, n), and filled
# in place before anything else can see it.
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_BYTES_DATA_OFFSET = sys.getsizeof(b"") - 1  # header size: where ob_sval starts


def value_parts(buffers, what: str, writable: bool) -> Parts:
    """A Parts over `buffers` (each anything readable_view / writable_view takes)."""
    if isinstance(buffers, (bytes, bytearray, memoryview)) or not hasattr(buffers, "__iter__"):
        raise InvalidArgumentError(f"{what} must be a sequence of buffers")
    return Parts(writable_view(b) if writable else readable_view(b) for b in buffers)


def checksum_of(data) -> int:
    """The object checksum of a flat view or of Parts (as if they were one buffer)."""
    if isinstance(data, Parts):
        digest = Digest()
        for view in data.views:
            digest.update(view)
        return digest.intdigest()
    return checksum(data)


def readable_view(value) -> memoryview:
    """`value` as a 1-D uint8 memoryview (may be read-only)."""
    if type(value) is bytes or type(value) is bytearray:  # the common case, already flat bytes
        return memoryview(value)
    if isinstance(value, Parts):
        return value
    return _flat(value, "value")


def fresh_bytes_view(size: int) -> memoryview:
    """A writable view of a new, not yet shared bytes object of `size` bytes (see bytes_of)."""
    if size == 0:
        return memoryview(bytearray())  # b"" is a shared singleton: never write into it
    value = _new_bytes(None, size)
    window = (ctypes.c_char * size).from_address(id(value) + _BYTES_DATA_OFFSET)
    window.value_object = value  # keeps the bytes alive as long as the view
    return memoryview(window).cast("B")


def bytes_of(view: memoryview) -> bytes:
    """The bytes object behind a view from fresh_bytes_view (or of a whole bytes object)."""
    window = view.obj
    if type(window) is bytes and len(window) == len(view):
        return window
    return window.value_object if hasattr(window, "value_object") else bytes(view)


def writable_view(buffer) -> memoryview:
    """`buffer` as a writable 1-D uint8 memoryview, for get_into destinations."""
    if isinstance(buffer, Parts):
        return buffer
    view = memoryview(buffer) if type(buffer) is bytearray else _flat(buffer, "buffer")
    if view.readonly:
        raise InvalidArgumentError(f"buffer of type {type(buffer).__name__} is read-only")
    return view


def _flat(obj, what: str) -> memoryview:
    try:
        view = memoryview(obj)
    except TypeError:
        view = _tensor_view(obj)
        if view is None:
            raise InvalidArgumentError(
                f"{what} of type {type(obj).__name__} is not a bytes-like object, numpy array "
                "or torch tensor") from None
    if view.format == "B" and view.ndim == 1 and view.c_contiguous:
        return view
    if not view.c_contiguous:
        raise InvalidArgumentError(f"{what} is not contiguous; pass a contiguous copy")
    try:
        return view.cast("B")
    except (TypeError, ValueError):  # cast() only knows native single-letter formats
        pass
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(obj, numpy.ndarray):  # e.g. big-endian or structured dtypes
        return memoryview(obj.reshape(-1).view(numpy.uint8))
    raise InvalidArgumentError(f"{what} has buffer format {view.format!r}, which cannot be viewed as bytes")


def _tensor_view(obj) -> memoryview | None:
    # torch is looked up, never imported: importing it costs seconds and most callers lack it.
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor):
        return None
    if obj.device.type != "cpu":
        raise InvalidArgumentError(f"tensor is on {obj.device}; kvpool takes CPU and CUDA tensors")
    if not obj.is_contiguous():
        raise InvalidArgumentError("tensor is not contiguous; pass tensor.contiguous()")
    # Flat uint8 view of the same storage; numpy() shares memory with the tensor.
    return memoryview(obj.detach().reshape(-1).view(torch.uint8).numpy())
