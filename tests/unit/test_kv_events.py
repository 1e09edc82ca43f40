"""Engine KV events (vLLM's ZMQ + msgpack format) into a router's engine view (connectors/kv_events.py), over real
ZMQ sockets."""

import asyncio

import msgspec
import pytest
import zmq
import zmq.asyncio
from block_hash_golden import RANGE_32_BS4_SHA256, range_blocks

from kvpool.connectors.kv_events import EngineEvents, apply_batch
from kvpool.connectors.router import EngineView

BS = 4


def batch(*events) -> bytes:
    """A KVEventBatch as vLLM encodes it: [ts, events, dp_rank], each event a map tagged by "type"."""
    return msgspec.msgpack.encode([1.5, list(events), None])


def stored(hashes, parent, tokens, medium="CPU", extra=None):
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
             "block_size": BS, "lora_id": None, "medium": medium, "lora_name": None}
    if extra is not None:
        event["extra_keys"] = extra
    return event


def test_a_batch_in_vllms_format_updates_the_view():
    view = EngineView("e")
    prompt = list(range(3 * BS))
    assert apply_batch(view, batch(stored([b"h1", b"h2"], None, prompt[:2 * BS]),
                                   stored([b"h3"], b"h2", prompt[2 * BS:]),
                                   stored([b"x"], None, list(range(100, 104)), medium="STORAGE"))) == 3
    assert view.blocks == range_blocks(3 * BS)  # the offloaded block is not the engine's own
    apply_batch(view, batch({"type": "BlockRemoved", "block_hashes": [b"h3"], "medium": "CPU"}))
    assert view.blocks == set(RANGE_32_BS4_SHA256[:2])
    apply_batch(view, batch({"type": "AllBlocksCleared"}))
    assert not view.blocks
    with pytest.raises(ValueError):
        apply_batch(view, msgspec.msgpack.encode({"not": "a batch"}))


def test_events_over_zmq_and_a_lost_message_clears_the_view():
    async def main():
        context = zmq.asyncio.Context()
        pub = context.socket(zmq.PUB)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        view = EngineView("e")
        follower = EngineEvents(view, f"tcp://127.0.0.1:{port}")
        task = asyncio.ensure_future(follower.run())
        try:
            await follower.subscribed.wait()
            await exchange(pub, view, follower)
        finally:  # also on a failed assert: a socket left open makes the context's term() wait forever
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            pub.close(linger=0)
            context.term()

    async def exchange(pub, view, follower):
        prompt = list(range(2 * BS))

        async def publish(seq: int, payload: bytes):
            await pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

        async def until(predicate):
            async with asyncio.timeout(10):
                while not predicate():
                    await asyncio.sleep(0.01)  # a PUB drops what it sends before the SUB has joined: resend
                    await publish(0, batch(stored([b"a"], None, prompt[:BS])))

        await until(lambda: view.blocks)
        await publish(1, batch(stored([b"b"], b"a", prompt[BS:])))
        async with asyncio.timeout(10):
            while len(view.blocks) < 2:
                await asyncio.sleep(0.01)
        assert view.blocks == range_blocks(2 * BS)
        await publish(5, batch())  # 2..4 never came
        async with asyncio.timeout(10):
            while follower.gaps == 0:
                await asyncio.sleep(0.01)
        assert not view.blocks

    asyncio.run(main())
