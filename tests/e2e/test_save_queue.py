"""The engines' save queue against real clusters: what is written is the copy made when a save was staged
(the engine may reuse its blocks at once), blocks already stored are not written again, a pool that refuses
puts for space or stops answering makes the queue shed saves instead of queueing them, and it takes saves
again once the pool has room."""

import os
import signal

import pytest

from kvpool import Client
from kvpool.connectors.save_queue import SaveQueue
from kvpool.errors import BatchError
from kvpool.net.netutil import wait_until

torch = pytest.importorskip("torch")

BLOCKS, LAYERS = 8, 2


def caches(seed: int) -> list:
    """Two layers of block-first paged caches: (blocks, heads, tokens, 2 x head_dim) float32, 16 KiB a block."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, 2, 16, 64, generator=generator) for _ in range(LAYERS)]


def block_bytes(layers: list, block: int) -> bytes:
    return b"".join(layer[block].numpy().tobytes() for layer in layers)


SIZE = LAYERS * 2 * 16 * 64 * 4


def outcomes_until(queue: SaveQueue, count: int, timeout: float = 20.0) -> list:
    done = []
    wait_until(lambda: done.extend(queue.outcomes()) or len(done) >= count, timeout, what=f"{count} outcomes")
    return done


def test_the_staged_copy_is_written_and_stored_blocks_are_not_written_again(cluster):
    layers = caches(1)
    keys = [f"save-queue/{os.getpid()}/{n}" for n in range(3)]
    before = [block_bytes(layers, block) for block in (1, 3, 5)]
    queue = SaveQueue(Client(cluster.master_address), 1 << 20)
    try:
        queue.stage("first", keys, [1, 3, 5], layers, False, SIZE)
        for layer in layers:  # the engine reuses its blocks right after the step
            layer.zero_()
        [saved] = outcomes_until(queue, 1)
        assert (saved.tag, saved.blocks, saved.written, saved.shed) == ("first", 3, 3, 0)
        with Client(cluster.master_address) as reader:
            assert [reader.get(key) for key in keys] == before
        queue.stage("again", keys, [1, 3, 5], layers, False, SIZE)
        [again] = outcomes_until(queue, 1)
        assert (again.blocks, again.written) == (3, 0)  # all there: nothing written, nothing failed
        with Client(cluster.master_address) as reader:
            assert [reader.get(key) for key in keys] == before
        assert queue.pending_bytes() == 0
    finally:
        queue.close(10)


def test_a_pool_with_no_room_makes_the_queue_shed_then_take_saves_again(own_cluster):
    running = own_cluster(1, dram_per_node="4MiB")
    layers = caches(2)
    with Client(running.master_address) as filler:
        fill = [f"fill/{n}" for n in range(640)]
        no_room = 0
        for key in fill:  # 5 MiB, each held once its end is answered: the node evicts nothing held
            filler.put(key, b"f" * (8 << 10))
            try:
                filler.flush()  # a hold asked before the master committed the put would hold nothing
            except BatchError:
                no_room += 1
                continue
            filler.batch_exists([key], hold=120)
        assert no_room  # the puts that found no room
        queue = SaveQueue(Client(running.master_address), 1 << 20)
        try:
            refused = []
            for n in range(20):  # the first may still find room the fill's last puts left
                queue.stage("refused", [f"full/{n}/0", f"full/{n}/1"], [0, 1], layers, False, SIZE)
                refused = [s for s in outcomes_until(queue, 1) if s.written is None]
                if refused:
                    break
            assert refused and refused[0].blocks == 2  # evicted before they ended
            # Refused for space: the next saves are shed in the step, not staged.
            queue.stage("shed", ["shed/2", "shed/3", "shed/4"], [2, 3, 4], layers, False, SIZE)
            [shed] = outcomes_until(queue, 1)
            assert (shed.tag, shed.blocks, shed.shed) == ("shed", 0, 3) and queue.pending_bytes() == 0
            for key in fill:
                if filler.exists(key):
                    filler.remove(key)
            # Room again: once the shedding window passes a save is written (the window doubles while the
            # pool keeps refusing, so this waits a few of them at most).
            written = []

            def saved():
                queue.stage("later", ["room/0"], [0], layers, False, SIZE)
                written.extend(s for s in outcomes_until(queue, 1) if s.written)
                return written

            wait_until(saved, 30, what="a save written once the pool has room")
            assert filler.get("room/0") == block_bytes(layers, 0)
        finally:
            queue.close(10)


def test_a_pool_that_stops_answering_fills_the_ring_and_saves_are_shed_not_waited_for(own_cluster):
    running = own_cluster(1)
    layers = caches(3)
    queue = SaveQueue(Client(running.master_address, timeout=1.0), 4 * SIZE)
    node = running.nodes[0]
    try:
        queue.stage("warm", ["stop/warm"], [0], layers, False, SIZE)  # connected to the node
        assert outcomes_until(queue, 1)[0].written == 1
        node.signal(signal.SIGSTOP)  # connected, but nothing is answered any more
        try:
            queue.stage("stuck", ["stop/0", "stop/1", "stop/2", "stop/3"], [0, 1, 2, 3], layers, False, SIZE)
            wait_until(lambda: queue._writing, 10, what="the writer to take the staged saves")
            queue.stage("no room", ["stop/4"], [4], layers, False, SIZE)  # the ring is full: shed at once, ...
            assert queue.pending_bytes() == 4 * SIZE  # ... while the writer is still stuck on the node
            outcomes = {saved.tag: saved for saved in outcomes_until(queue, 2, timeout=30)}
            assert outcomes["no room"].shed == 1
            assert outcomes["stuck"].written is None  # past its deadline: not saved, and ...
            queue.stage("after", ["stop/5"], [5], layers, False, SIZE)
            [after] = outcomes_until(queue, 1)
            assert after.shed == 1  # ... the pool pushed back: shed for a while
        finally:
            node.signal(signal.SIGCONT)
    finally:
        queue.close(10)
