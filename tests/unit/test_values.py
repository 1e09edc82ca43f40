"""Values and destination buffers become flat byte views of the caller's memory, never copies."""

import array

import numpy as np
import pytest

from kvpool.client.values import readable_view, writable_view
from kvpool.errors import InvalidArgumentError


def test_bytes_and_bytearray_are_viewed_in_place():
    data = bytearray(b"abcdef")
    view = readable_view(data)
    data[0] = ord("z")
    assert view.tobytes() == b"zbcdef"
    assert readable_view(b"xyz").readonly


def test_memoryview_slice_keeps_its_window():
    base = bytearray(range(10))
    view = readable_view(memoryview(base)[2:6])
    assert view.tobytes() == bytes([2, 3, 4, 5])
    writable_view(memoryview(base)[4:6])[:] = b"\xff\xff"
    assert base[4:6] == b"\xff\xff"


def test_numpy_array_shares_memory_as_bytes():
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    view = readable_view(arr)
    assert (view.format, view.ndim, len(view)) == ("B", 1, arr.nbytes)
    assert view.tobytes() == arr.tobytes()
    dest = np.zeros(12, dtype=np.float32)
    writable_view(dest)[:] = view
    assert np.array_equal(dest.reshape(3, 4), arr)


def test_numpy_dtypes_without_a_native_buffer_format():
    big_endian = np.arange(6, dtype=">i4")
    assert readable_view(big_endian).tobytes() == big_endian.tobytes()
    record = np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8")])
    assert len(readable_view(record)) == record.nbytes


def test_other_buffer_objects():
    numbers = array.array("q", [1, 2, 3])
    assert len(readable_view(numbers)) == 24


@pytest.mark.parametrize("value", [
    np.arange(16, dtype=np.uint8)[::2],
    np.arange(12, dtype=np.int32).reshape(3, 4).T,
    memoryview(bytes(10))[::3],
])
def test_non_contiguous_is_refused(value):
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        readable_view(value)


@pytest.mark.parametrize("value", ["text", 42, None, [1, 2]])
def test_unsupported_types_are_refused(value):
    with pytest.raises(InvalidArgumentError, match="type"):
        readable_view(value)


@pytest.mark.parametrize("buffer", [b"immutable", memoryview(b"immutable"), np.zeros(4).copy()])
def test_read_only_destination_is_refused(buffer):
    if isinstance(buffer, np.ndarray):
        buffer.flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        writable_view(buffer)


def test_torch_tensor_is_viewed_without_copy():
    torch = pytest.importorskip("torch")
    tensor = torch.arange(8, dtype=torch.float16).reshape(2, 4)
    view = readable_view(tensor)
    assert len(view) == 16 and view.tobytes() == tensor.numpy().tobytes()
    dest = torch.zeros(8, dtype=torch.float16)
    writable_view(dest)[:] = view
    assert torch.equal(dest.reshape(2, 4), tensor)


def test_torch_non_contiguous_tensor_is_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        readable_view(torch.zeros(4, 4).t())


def test_fresh_bytes_view_fills_a_new_bytes_object():
    from kvpool.client.values import bytes_of, fresh_bytes_view

    view = fresh_bytes_view(5)
    view[:] = b"hello"
    value = bytes_of(view)
    assert type(value) is bytes and value == b"hello"
    other = fresh_bytes_view(5)
    other[:] = b"world"
    assert bytes_of(other) == b"world" and value == b"hello"  # each view owns its own object
    assert bytes_of(fresh_bytes_view(0)) == b""


def test_decompression_refuses_a_raw_size_the_stored_bytes_cannot_have():
    from kvpool.client import compression
    from kvpool.errors import ChecksumMismatchError

    packed = compression.encode(memoryview(b"token " * 1000), True, None)
    assert compression.decode(packed, 6000, "k") == b"token " * 1000
    with pytest.raises(ChecksumMismatchError, match="raw_size"):  # refused before allocating 32 TiB
        compression.decode(packed, 2**45, "k")
