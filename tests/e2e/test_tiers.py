"""DRAM and SSD as one managed pool, seen through the client: demotion, eviction, pins, holds, TTL,
restart recovery and compression, with real etcd, master and storage node processes."""

import os
import threading

import pytest

from kvpool import Client
from kvpool.errors import KeyNotFoundError, NoSpaceError
from kvpool.net.netutil import wait_until
from storenode_harness import FAIL_FAST, PATIENT_TIMEOUTS, metric_samples, metric_total

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 512 * KiB


def _tiers(cluster, node_index: int = 0) -> dict:
    """{'DRAM': TierStats, 'SSD': TierStats} of one node, from the master's Stats."""
    from kvpool.proto import kvpool_pb2

    node = sorted(cluster.master_stats().nodes, key=lambda n: n.node_id)[node_index]
    return {kvpool_pb2.Tier.Name(t.tier): t for t in node.tiers}


def _one_node(own_cluster, dram="8MiB", ssd="16MiB", node_args=()):
    return own_cluster(nodes=1, dram_per_node=dram, ssd_per_node=ssd,
                       node_args=["--high-watermark", "0.9", "--low-watermark", "0.6", *node_args],
                       master_args=["--report-interval", "0.2"])


def _present(client, keys) -> list:
    return [k for k, v in zip(keys, client.batch_exists(keys)) if v]


def test_dram_overflow_is_demoted_to_ssd_and_still_served(own_cluster):
    cluster = _one_node(own_cluster)
    values = {f"demote/{i}": os.urandom(BLOCK) for i in range(20)}  # 10 MiB: more than DRAM's 8 MiB
    with Client(cluster.master_address) as c:
        for key, value in values.items():
            c.put(key, value)
        def demoted():
            tiers = _tiers(cluster)
            return (tiers["SSD"].objects > 0 and tiers["DRAM"].demotions > 0 and tiers["DRAM"].watermark != "high"
                    and tiers["DRAM"].used <= 0.9 * tiers["DRAM"].capacity)

        wait_until(demoted, timeout=20, what="demotion to SSD, DRAM back under its high watermark")
        for key, value in values.items():  # nothing was lost: every byte comes back
            assert c.get(key) == value
        wait_until(lambda: _tiers(cluster)["SSD"].hits > 0, timeout=10, what="reads served from SSD")


def test_full_ssd_evicts_the_coldest_for_good(own_cluster):
    cluster = _one_node(own_cluster, dram="4MiB", ssd="8MiB")
    keys = [f"evict/{i:03d}" for i in range(40)]  # 20 MiB into 12 MiB of pool
    values = {}
    with Client(cluster.master_address) as c:
        for key in keys:
            values[key] = os.urandom(BLOCK)
            c.put(key, values[key])
            c.get(keys[0])  # keep the first key hot

        def settled():  # every eviction the node counted is known to the master, and they stopped
            tiers = _tiers(cluster)
            evicted = tiers["SSD"].evictions + tiers["DRAM"].evictions
            gone = [k for k in keys if k not in _present(c, keys)]
            return evicted > 0 and len(gone) == evicted and gone

        gone = wait_until(settled, timeout=20, what="the master to drop every evicted key")
        # LRU: the keys leave in the order they were last used, so exactly the oldest went (the hot one stayed).
        assert gone == keys[1:1 + len(gone)], gone
        present = _present(c, keys)
        assert present == [keys[0], *keys[1 + len(gone):]]
        for key in gone[:3]:
            with pytest.raises(KeyNotFoundError):
                c.get(key)
        assert c.get(keys[0]) == values[keys[0]]
        readable = 0
        for key in present:  # sweeps may still be running: a key is whole or gone, never wrong
            try:
                assert c.get(key) == values[key]
                readable += 1
            except KeyNotFoundError:
                pass
        assert readable >= len(present) // 2


def test_pins_survive_a_sweep_that_evicts_unpinned(own_cluster):
    cluster = _one_node(own_cluster, dram="4MiB", ssd="4MiB")
    with Client(cluster.master_address) as c:
        hard = os.urandom(BLOCK)
        soft = os.urandom(BLOCK)
        c.put("pin/hard", hard, pin="hard")
        c.put("pin/soft", soft, pin="soft", pin_ttl=600)
        filler = [f"pin/fill/{i}" for i in range(24)]  # 12 MiB of unpinned data through 8 MiB of pool
        for key in filler:
            c.put(key, os.urandom(BLOCK))
        wait_until(lambda: len(_present(c, filler)) < len(filler), timeout=20, what="unpinned objects evicted")
        assert c.get("pin/hard") == hard
        assert c.get("pin/soft") == soft


def test_held_object_is_protected_until_the_hold_ends(own_cluster):
    cluster = _one_node(own_cluster, dram="4MiB", ssd="4MiB")
    with Client(cluster.master_address) as c:
        held = os.urandom(BLOCK)
        c.put("hold/k", held)
        assert c.exists("hold/k", hold=8)
        for i in range(24):
            c.put(f"hold/fill/{i}", os.urandom(BLOCK))
        wait_until(lambda: _tiers(cluster)["SSD"].evictions > 4, timeout=20, what="a sweep")
        assert c.get("hold/k") == held  # the coldest object, yet held
        # A plain exists() renews nothing: once the hold lapses the object is evictable again.
        assert c.exists("hold/k")

        more = iter(range(10_000))

        def evicted_after_hold():
            for _ in range(8):  # fresh keys: the pool must keep needing room
                c.put(f"hold/more/{next(more)}", os.urandom(BLOCK))
            return not c.exists("hold/k")

        wait_until(evicted_after_hold, timeout=30, interval=0.3, what="eviction after the hold ended")


def test_put_fails_fast_with_no_space_when_nothing_can_be_evicted(own_cluster):
    import time

    cluster = _one_node(own_cluster, dram="4MiB", ssd="0", node_args=["--hard-pin-quota", "8MiB"])
    with Client(cluster.master_address, **PATIENT_TIMEOUTS) as c:
        stored = 0
        with pytest.raises(NoSpaceError):
            for i in range(16):  # hard-pinned objects fill DRAM: nothing in it may be evicted
                c.put(f"full/{i}", os.urandom(BLOCK), pin="hard")
                stored += 1
        assert 4 <= stored <= 8
        started = time.monotonic()
        with pytest.raises(NoSpaceError):
            c.put("full/unpinned", os.urandom(BLOCK))
        assert time.monotonic() - started < FAIL_FAST  # fails fast, never waits out a timeout
        assert not c.exists("full/unpinned")
        assert len(c.get("full/0")) == BLOCK  # what was stored is untouched


def test_restarted_node_serves_its_ssd_objects_again(own_cluster):
    cluster = _one_node(own_cluster, dram="4MiB", ssd="32MiB")
    values = {f"restart/{i}": os.urandom(300 * KiB + i) for i in range(10)}
    with Client(cluster.master_address) as c:
        for key, value in values.items():
            c.put(key, value, tier="ssd")
        cluster.nodes[0].kill()
        cluster.restart_node(0)
        wait_until(lambda: all(c.batch_exists(list(values))), timeout=20, what="SSD objects re-adopted")
        for key, value in values.items():
            assert c.get(key) == value


def test_reads_racing_eviction_never_return_wrong_bytes(own_cluster):
    cluster = _one_node(own_cluster, dram="4MiB", ssd="4MiB")
    stop = threading.Event()
    wrong = []
    with Client(cluster.master_address) as writer, Client(cluster.master_address) as reader:
        writer.put("race/0", b"\x01" * BLOCK)

        def read_loop():
            while not stop.is_set():
                for i in range(0, 40, 3):
                    try:
                        value = reader.get(f"race/{i}")
                    except KeyNotFoundError:
                        continue
                    if value != bytes([i % 251 + 1]) * BLOCK:
                        wrong.append(i)

        thread = threading.Thread(target=read_loop)
        thread.start()
        try:
            for i in range(1, 40):
                writer.put(f"race/{i}", bytes([i % 251 + 1]) * BLOCK)
            wait_until(lambda: _tiers(cluster)["SSD"].evictions > 0, timeout=20, what="evictions")
        finally:
            stop.set()
            thread.join()
    assert wrong == []


def test_ttl_expires_objects(own_cluster):
    cluster = _one_node(own_cluster)
    with Client(cluster.master_address) as c:
        c.put("ttl/short", b"soon gone", ttl=1)
        c.put("ttl/long", b"stays")
        assert c.get("ttl/short") == b"soon gone"
        wait_until(lambda: not c.exists("ttl/short"), timeout=10, what="expiry")
        with pytest.raises(KeyNotFoundError):
            c.get("ttl/short")
        assert c.get("ttl/long") == b"stays"


def test_compressed_values_round_trip(own_cluster):
    cluster = _one_node(own_cluster)
    value = (b"token-block " * 50_000)[:500_000]
    with Client(cluster.master_address) as c:
        c.put("lz4/k", value, compress=True)
        assert c.get("lz4/k") == value
        buf = bytearray(len(value))
        assert c.get_into("lz4/k", buf) == len(value) and bytes(buf) == value
        wait_until(lambda: 0 < _tiers(cluster)["DRAM"].used < len(value) // 4, timeout=10,
                   what="the node to report the compressed size")  # stored compressed


def test_promote_after_n_reads_copies_an_ssd_object_to_dram_at_the_nth_read(own_cluster):
    """--promote-after 3: an SSD-only object read twice stays on SSD; one read three times is copied to DRAM."""
    cluster = own_cluster(nodes=1, dram_per_node="8MiB", ssd_per_node="16MiB", metrics=True,
                          node_args=["--promote-after", "3"])
    url = cluster.metrics_urls["node-0"]

    def dram(name: str) -> float:
        return metric_total(metric_samples(url), name, tier="dram")

    values = {key: os.urandom(BLOCK) for key in ("promote/twice", "promote/thrice")}
    with Client(cluster.master_address, transports="tcp") as c:
        for key, value in values.items():
            c.put(key, value, tier="ssd")
        assert dram("kvpool_node_objects") == 0
        for _ in range(2):
            assert c.get("promote/twice") == values["promote/twice"]
        # Read after the other one's two: had two reads been enough, its copy would have started first.
        for _ in range(3):
            assert c.get("promote/thrice") == values["promote/thrice"]
        wait_until(lambda: dram("kvpool_node_objects") >= 1, 20, what="the object read three times in DRAM")
        assert dram("kvpool_node_tier_promotions_total") == 1 and dram("kvpool_node_objects") == 1
        assert dram("kvpool_node_tier_hits_total") == 0  # every read so far came from SSD
        assert c.get("promote/thrice") == values["promote/thrice"]
        assert dram("kvpool_node_tier_hits_total") == 1  # now served from DRAM
        assert c.get("promote/twice") == values["promote/twice"]  # its third read
        wait_until(lambda: dram("kvpool_node_objects") == 2, 20, what="the other object in DRAM after its third")
        assert dram("kvpool_node_tier_promotions_total") == 2
