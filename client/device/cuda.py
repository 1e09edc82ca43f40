"""The copy engine for CUDA memory, through torch: torch CUDA tensors, and anything exposing
__cuda_array_interface__ (CuPy, Numba) or DLPack on a CUDA device, taken as torch tensors without a copy.

Copies run on one CUDA stream of the client's, created on the device of the first tensor it meets, as
cudaMemcpyAsync between device memory and page-locked host memory: torch's pinned allocations for staging,
and the node's shared-memory segment registered with cudaHostRegister, so a same-host transfer is one DMA
between the GPU and the node's DRAM. The caller's stream is ordered against it with events only.
"""

import sys

from kvpool.errors import DeviceCopyError, InvalidArgumentError

from .engine import CopyEngine, Region

# DLPack device types of GPU memory (dlpack.h: kDLCUDA, kDLCUDAManaged); kDLCUDAHost is host memory.
_DLPACK_CUDA = (2, 13)


def looks_like_cuda(obj) -> bool:
    """Whether `obj` is CUDA memory this engine takes, decided without importing anything."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return obj.device.type == "cuda"
    if hasattr(obj, "__cuda_array_interface__"):
        return True
    device = getattr(obj, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return device()[0] in _DLPACK_CUDA
    except Exception:  # a broken producer: not ours to judge here
        return False


class _Region(Region):
    def __init__(self, tensor):
        self.tensor = tensor  # flat uint8
        self.nbytes = tensor.numel()

    def slice(self, offset: int, size: int) -> "_Region":
        return _Region(self.tensor[offset:offset + size])


class CudaCopyEngine(CopyEngine):
    name = "cuda"

    def __init__(self):
        try:
            import torch
        except ImportError:
            raise InvalidArgumentError("CUDA memory needs torch with CUDA (pip install torch)") from None
        if not torch.cuda.is_available():
            raise InvalidArgumentError("CUDA memory was given but torch sees no CUDA device")
        self.torch = torch
        self._stream = None  # made on the device of the first tensor
        self._registered: dict[int, object] = {}  # id(mapping) -> the mapping, registered with CUDA

    def _copy_stream(self, device):
        if self._stream is None:
            self._stream = self.torch.cuda.Stream(device=device)
        elif self._stream.device != device:
            raise InvalidArgumentError(f"tensor on {device}, but this client copies on {self._stream.device}: "
                                       "use one client per GPU")
        return self._stream

    def claims(self, obj) -> bool:
        return looks_like_cuda(obj)

    def region(self, obj, what: str, writable: bool) -> Region:
        torch = self.torch
        if not isinstance(obj, torch.Tensor):
            try:
                obj = torch.from_dlpack(obj) if hasattr(obj, "__dlpack__") else torch.as_tensor(obj, device="cuda")
            except (TypeError, RuntimeError, BufferError) as exc:
                raise InvalidArgumentError(f"{what} of type {type(obj).__name__}: not usable as CUDA memory "
                                           f"({exc})") from None
        if not obj.is_contiguous():
            raise InvalidArgumentError(f"{what} is not contiguous; pass tensor.contiguous()")
        self._copy_stream(obj.device)
        return _Region(obj.detach().reshape(-1).view(torch.uint8))

    def pinned(self, nbytes: int) -> memoryview:
        return memoryview(self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True).numpy())

    def register_host(self, view: memoryview) -> bool:
        mapping = view.obj
        if id(mapping) in self._registered:
            return True
        whole = self.torch.frombuffer(mapping, dtype=self.torch.uint8)
        cudart = self.torch.cuda.cudart()
        status = cudart.cudaHostRegister(whole.data_ptr(), whole.numel(), 0)
        if int(status) != 0:
            clear = getattr(cudart, "cudaGetLastError", None)
            if clear is not None:  # else a later kernel launch's check would report this failure as its own
                clear()
            return False
        self._registered[id(mapping)] = (mapping, whole)  # kept: unregistered only with the process
        return True

    def _host(self, view: memoryview):
        return self.torch.frombuffer(view, dtype=self.torch.uint8)

    def to_host(self, source: _Region, dest: memoryview) -> None:
        with self.torch.cuda.stream(self._stream):
            self._run(lambda: self._host(dest).copy_(source.tensor, non_blocking=True))

    def to_device(self, source: memoryview, dest: _Region) -> None:
        with self.torch.cuda.stream(self._stream):
            self._run(lambda: dest.tensor.copy_(self._host(source), non_blocking=True))

    def record(self):
        event = self.torch.cuda.Event()
        event.record(self._stream)
        return event

    def copy_after_caller(self) -> None:
        self._stream.wait_stream(self.torch.cuda.current_stream(self._stream.device))

    def caller_after(self, event) -> None:
        self.torch.cuda.current_stream(self._stream.device).wait_event(event)

    def done(self, event) -> bool:
        return self._run(event.query)

    def wait(self, event) -> None:
        if event is not None:
            self._run(event.synchronize)

    @staticmethod
    def _run(call):
        try:
            return call()
        except RuntimeError as exc:  # torch reports CUDA errors as RuntimeError
            raise DeviceCopyError(f"CUDA copy failed: {exc}") from None
