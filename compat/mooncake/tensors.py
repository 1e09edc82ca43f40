"""put_tensor / get_tensor's stored form: a header naming the dtype and shape, then the tensor's bytes.

    b"KVPT" | version (1 byte) | dtype name length (1 byte) | dtype name (ASCII, e.g. "float16")
    | ndim (1 byte) | each dimension (8 bytes, little-endian) | the bytes, C order

Read and written only by this package (Mooncake's own header differs): a golden value in
tests/unit/test_mooncake_config.py keeps it from changing by accident.
"""

import struct

MAGIC = b"KVPT"
VERSION = 1
MAX_DIMS = 32


def header(tensor) -> bytes:
    name = str(tensor.dtype).removeprefix("torch.").encode("ascii")
    shape = tuple(tensor.shape)
    if len(shape) > MAX_DIMS:
        raise ValueError(f"a tensor of {len(shape)} dimensions (at most {MAX_DIMS})")
    return MAGIC + bytes((VERSION, len(name))) + name + bytes((len(shape),)) + struct.pack(f"<{len(shape)}Q", *shape)


def parts(tensor) -> list:
    """The header and a byte view of the tensor's memory (made contiguous, on the CPU)."""
    import torch

    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    flat = data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
    return [header(tensor), flat.numpy()]


def tensor_of(value: bytes | bytearray):
    """The tensor a stored value holds; ValueError for bytes put_tensor did not write."""
    import torch

    view = memoryview(value)
    if len(view) < 7 or bytes(view[:4]) != MAGIC or view[4] != VERSION:
        raise ValueError("not a tensor stored by put_tensor")
    name_end = 6 + view[5]
    dtype = getattr(torch, bytes(view[6:name_end]).decode("ascii"), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError("a tensor of an unknown dtype")
    ndim = view[name_end]
    data_start = name_end + 1 + 8 * ndim
    if len(view) < data_start:
        raise ValueError("a tensor header cut short")
    shape = struct.unpack_from(f"<{ndim}Q", view, name_end + 1)
    data = bytearray(view[data_start:])
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)
