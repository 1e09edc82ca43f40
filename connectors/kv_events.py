"""An engine's KV events, into the router's view of its cache (connectors/router.py EngineView).

vLLM started with `--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557"}'` publishes on a ZMQ PUB socket, per batch of cache changes, three frames: the topic, a
sequence number (8 bytes, big-endian) and a msgpack KVEventBatch `[ts, events, data_parallel_rank]` whose
events are maps tagged by "type": BlockStored (block_hashes, parent_block_hash, token_ids, block_size,
extra_keys, medium, ...), BlockRemoved (block_hashes, medium) and AllBlocksCleared. Only the engine's own cache
counts (medium "GPU" or "CPU", or none given): blocks it offloaded elsewhere are not where its prefix cache hits.

A gap in the sequence means events were lost (PUB drops what a slow subscriber cannot take): the view is
cleared rather than trusted, and fills again as the engine stores; a router then under-counts an engine for a
while, never over-counts it. A sequence starting again at 0 is an engine that restarted (its cache is new);
a number seen already is skipped.

Needs the `router` extra (pyzmq, msgspec).
"""

import asyncio
import logging

from .router import EngineView

log = logging.getLogger(__name__)

OWN_MEDIA = (None, "GPU", "CPU")


def apply_batch(view: EngineView, payload: bytes) -> int:
    """Apply one msgpack KVEventBatch to `view`; returns how many events it held."""
    import msgspec

    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, (list, tuple)) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KVEventBatch")
    for event in batch[1]:
        kind = event.get("type") if isinstance(event, dict) else None
        if kind == "AllBlocksCleared":
            view.cleared()
        elif event.get("medium") not in OWN_MEDIA:
            continue
        elif kind == "BlockStored":
            view.stored(event["block_hashes"], event.get("parent_block_hash"), event["token_ids"],
                        event["block_size"], event.get("extra_keys"))
        elif kind == "BlockRemoved":
            view.removed(event["block_hashes"])
    return len(batch[1])


class EngineEvents:
    """Follows one engine's event stream into its view, until cancelled."""

    def __init__(self, view: EngineView, endpoint: str, topic: str = ""):
        self.view = view
        self.endpoint = endpoint
        self.topic = topic
        self.batches = 0
        self.gaps = 0
        self._last_seq: int | None = None
        self.subscribed = asyncio.Event()

    async def run(self) -> None:
        import zmq
        import zmq.asyncio

        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self.subscribed.set()
        try:
            while True:
                frames = await sub.recv_multipart()
                self.take(frames)
        finally:
            sub.close()

    def take(self, frames: list[bytes]) -> None:
        """One published message: (topic, sequence, payload)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            log.warning("engine %s: ignored a KV event message of %d frames", self.view.name, len(frames))
            return
        seq = int.from_bytes(frames[1], "big")
        last = self._last_seq
        if last is not None and seq != last + 1:
            if seq == 0:  # the engine started again: its cache is new
                self.view.cleared()
            elif seq <= last:  # seen already
                return
            else:
                self.gaps += 1
                log.warning("engine %s: KV events %d..%d lost; forgetting what it held", self.view.name,
                            last + 1, seq - 1)
                self.view.cleared()
        self._last_seq = seq
        try:
            apply_batch(self.view, frames[2])
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("engine %s: a KV event batch could not be read (%s); forgetting what it held",
                        self.view.name, exc)
            self.view.cleared()
            return
        self.batches += 1
