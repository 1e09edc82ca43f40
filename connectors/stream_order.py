"""Ordering a transfer on another thread against the engine's stream, device-side (no host waits).

vLLM asks for a load or save on its own thread, where its kernels run on the current CUDA stream; with transfer
"async" the blocks move on the connector's thread, whose current stream may be another. An event recorded on the
engine's stream when the transfer is asked for (`mark`) is what the moving thread waits for (`follow`) before it
gathers the blocks; the event it records after scattering a load is what the engine's stream waits for before
the request runs. CPU caches need neither: their copies are done when the calls return.
"""

from typing import Sequence


def mark(layer_caches: Sequence):
    """An event after the work queued so far on the current stream of the caches' GPU; None for CPU caches."""
    if not layer_caches or layer_caches[0].device.type != "cuda":
        return None
    import torch
    device = layer_caches[0].device
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event, device


def follow(marked) -> None:
    """Work queued on this thread's current stream from now on waits for what `mark` recorded (None: nothing)."""
    if marked is None:
        return
    import torch
    event, device = marked
    torch.cuda.current_stream(device).wait_event(event)
