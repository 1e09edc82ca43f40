"""DRAM and SSD tiers of a real node process: demotion, eviction, pins, holds, promotion, recovery, races."""

import os
import socket
import threading
import time

import pytest
from storenode_harness import (free, get, hold, inventory, put, read_frame, read_reply, report, start_node,
                               write_frame, write_status)

from kvpool.security import auth
from kvpool.protocol import wire
from kvpool.errors import Code
from kvpool.net.netutil import wait_until
from kvpool.protocol.wire import WriteFlag

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture
def nodes(etcd, tmp_path):
    """start(*args, node_id=...) -> Node; every node is killed at the end and must not have crashed."""
    started = []

    def start(*args, node_id="t1", dram="4MiB"):
        # The band these tests' sizes were chosen for, whatever the default.
        args = ("--high-watermark", "0.9", "--low-watermark", "0.75", *args)
        node = start_node(etcd, tmp_path, node_id=node_id, dram=dram, args=args)
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()
        assert "Traceback" not in node.log()


def objects(n: int, size: int, prefix: str = "o") -> list[tuple[bytes, bytes]]:
    return [(f"{prefix}{i}".encode(), os.urandom(size)) for i in range(n)]


class EvictedLog:
    """Collects REPORT's evicted lists (each REPORT drains them)."""

    def __init__(self, node):
        self.node = node
        self.keys: list[str] = []

    def poll(self) -> dict:
        got = report(self.node)
        self.keys += [key for key, _ in got["evicted"]]
        return got


def test_dram_above_high_watermark_demotes_coldest_to_ssd(nodes, tmp_path):
    node = nodes("--ssd", "16MiB", "--data-dir", str(tmp_path / "d"))
    objs = objects(16, 256 * KiB)  # 4 MiB: a full DRAM tier
    for key, data in objs:
        put(node, key, 1, data)
    got = wait_until(lambda: (r := report(node))["tiers"]["dram"]["watermark"] != "high" and r, 10,
                     what="DRAM relieved")
    dram, ssd = got["tiers"]["dram"], got["tiers"]["ssd"]
    assert dram["used"] <= 0.9 * 4 * MiB  # relieved down to 75% (then later writes may add to it)
    assert dram["demotions"] == ssd["demotions"] > 0
    assert got["evicted"] == [] and dram["evictions"] == 0  # demoted, not lost
    inv = inventory(node)
    on_ssd = [i for i, (key, _) in enumerate(objs) if inv[(key.decode(), 1)]["tiers"] == ["ssd"]]
    assert on_ssd == list(range(len(on_ssd))) and on_ssd  # the coldest, i.e. the first written
    for key, data in objs:
        assert get(node, key, 1, len(data)) == (Code.OK, data)


def test_ssd_above_high_watermark_evicts_coldest_for_good(nodes, tmp_path):
    node = nodes("--ssd", "4MiB", "--data-dir", str(tmp_path / "d"))
    objs = objects(19, 200 * KiB)  # each takes 51 pages: 19 of them pass 90% of 4 MiB
    for i, (key, data) in enumerate(objs):
        put(node, key, 1, data, flags=WriteFlag.PREFER_SSD)
        if i == 9:  # one read makes o0 the most recently used
            assert get(node, b"o0", 1, len(objs[0][1])) == (Code.OK, objs[0][1])
    log = EvictedLog(node)
    got = wait_until(lambda: (r := log.poll())["tiers"]["ssd"]["watermark"] != "high" and r, 10,
                     what="SSD relieved")
    assert got["tiers"]["ssd"]["used"] <= 0.75 * 4 * MiB
    coldest_first = [key.decode() for key, _ in objs[1:10]] + ["o0"] + [key.decode() for key, _ in objs[10:]]
    assert log.keys and log.keys == coldest_first[:len(log.keys)]
    assert got["tiers"]["ssd"]["evictions"] == len(log.keys)
    for key, data in objs:
        status, payload = get(node, key, 1, len(data))
        assert (status, payload) == ((Code.NOT_FOUND, payload) if key.decode() in log.keys else (Code.OK, data))


def test_soft_pinned_survive_a_sweep_that_evicts_unpinned(nodes):
    node = nodes()  # DRAM only: relief means eviction
    soft = objects(4, 256 * KiB, "soft")
    plain = objects(12, 256 * KiB, "plain")
    for key, data in soft:
        put(node, key, 1, data, soft_pin_ms=600_000)
    for key, data in plain:
        put(node, key, 1, data)
    log = EvictedLog(node)
    wait_until(lambda: log.poll()["tiers"]["dram"]["watermark"] != "high" and log.keys, 10, what="eviction")
    assert log.keys == [key.decode() for key, _ in plain[:len(log.keys)]]  # soft ones are older, yet stay
    for key, data in soft:
        assert get(node, key, 1, len(data)) == (Code.OK, data)


def test_lfu_keeps_the_most_read_though_others_came_later(nodes):
    node = nodes("--policy", "lfu")  # DRAM only: relief means eviction
    popular = objects(4, 256 * KiB, "popular")
    plain = objects(12, 256 * KiB, "plain")
    for key, data in popular:
        put(node, key, 1, data)
        for _ in range(3):
            assert get(node, key, 1, len(data)) == (Code.OK, data)
    for key, data in plain:  # newer than every read of the popular ones: LRU would drop those first
        put(node, key, 1, data)
    log = EvictedLog(node)
    wait_until(lambda: log.poll()["tiers"]["dram"]["watermark"] != "high" and log.keys, 10, what="eviction")
    assert log.keys == [key.decode() for key, _ in plain[:len(log.keys)]]
    for key, data in popular:
        assert get(node, key, 1, len(data)) == (Code.OK, data)


def test_hard_pinned_never_evicted_and_quota_enforced(nodes):
    node = nodes("--hard-pin-quota", "1MiB")
    pinned = objects(4, 256 * KiB, "pin")
    for key, data in pinned:
        put(node, key, 1, data, flags=WriteFlag.HARD_PIN)
    status, message = write_status(node, b"one-more", 1, os.urandom(1000), flags=WriteFlag.HARD_PIN)
    assert status == Code.NO_SPACE and "quota" in message
    log = EvictedLog(node)
    for key, data in objects(30, 256 * KiB, "plain"):  # far more than fits: sweeps and write-path evictions
        put(node, key, 1, data)
    log.poll()
    assert log.keys and not any(k.startswith("pin") for k in log.keys)
    assert log.poll()["tiers"]["dram"]["pinned_bytes"] == 1 * MiB
    for key, data in pinned:
        assert get(node, key, 1, len(data)) == (Code.OK, data)
    assert free(node, b"pin0", 1) == Code.OK  # freeing gives quota back
    put(node, b"one-more", 1, os.urandom(1000), flags=WriteFlag.HARD_PIN)


def test_hold_protects_until_it_ends_and_nothing_evictable_is_no_space_fast(nodes):
    node = nodes("--hard-pin-quota", "2MiB")
    for key, data in objects(8, 256 * KiB, "pin"):
        put(node, key, 1, data, flags=WriteFlag.HARD_PIN)
    held = objects(6, 256 * KiB, "held")  # 3.5 MiB in all: below the high watermark, so no sweep runs
    for key, data in held:
        put(node, key, 1, data)
        assert hold(node, key, 1, 1500) == Code.OK
    began = time.monotonic()
    status, message = write_status(node, b"new", 1, os.urandom(1 * MiB))
    assert status == Code.NO_SPACE and "evict" in message
    assert time.monotonic() - began < 2.0  # refused at once, not after waiting for room
    assert get(node, b"held0", 1, len(held[0][1])) == (Code.OK, held[0][1])
    assert report(node)["evicted"] == []
    # Once the holds end the held objects are ordinary victims again.
    wait_until(lambda: write_status(node, b"new", 1, os.urandom(1 * MiB))[0] == Code.OK, 10,
               what="holds to end")
    log = EvictedLog(node)
    log.poll()
    assert log.keys and all(k.startswith("held") for k in log.keys)


def test_second_read_of_an_ssd_only_object_promotes_it(nodes, tmp_path):
    node = nodes("--ssd", "8MiB", "--data-dir", str(tmp_path / "d"))
    data = os.urandom(300 * KiB)
    put(node, b"cold", 1, data, flags=WriteFlag.PREFER_SSD)
    assert inventory(node)[("cold", 1)]["tiers"] == ["ssd"]
    assert get(node, b"cold", 1, len(data)) == (Code.OK, data)
    assert inventory(node)[("cold", 1)]["tiers"] == ["ssd"]  # one hit is not enough
    assert get(node, b"cold", 1, len(data)) == (Code.OK, data)
    wait_until(lambda: inventory(node)[("cold", 1)]["tiers"] == ["dram", "ssd"], 10, what="promotion")
    assert get(node, b"cold", 1, len(data)) == (Code.OK, data)
    tiers = report(node)["tiers"]
    assert (tiers["dram"]["promotions"], tiers["ssd"]["promotions"]) == (1, 1)
    assert (tiers["ssd"]["hits"], tiers["dram"]["hits"], tiers["dram"]["misses"]) == (2, 1, 2)


def _find(path: str, needle: bytes) -> int:
    with open(path, "rb") as f:
        return f.read().find(needle)


def test_kill_9_then_restart_recovers_intact_ssd_objects(etcd, nodes, tmp_path):
    from test_storenode_protocol import etcd_get

    from kvpool.protocol.cluster_layout import NodeRecord, node_key

    data_dir = str(tmp_path / "d")
    args = ("--ssd", "16MiB", "--data-dir", data_dir)
    node = nodes(*args)
    seg_file = os.path.join(data_dir, "ssd", "segment.kv")
    kept = objects(5, 100 * KiB, "kept") + [(b"tiny", b"t"), (b"ttl", os.urandom(5000))]
    for key, data in kept:
        put(node, key, 7, data, flags=WriteFlag.PREFER_SSD, ttl_ms=600_000 if key == b"ttl" else 0)
    damaged = os.urandom(200 * KiB)
    put(node, b"damaged", 7, damaged, flags=WriteFlag.PREFER_SSD)
    put(node, b"in-dram", 7, os.urandom(1000))
    old_segment = NodeRecord.from_json(etcd_get(etcd, node_key("default", "t1")).value).tiers["dram"].path

    # A large WRITE cut off mid-payload by the kill.
    torn = os.urandom(3 * MiB)
    frame = write_frame(b"torn", 7, torn, flags=WriteFlag.PREFER_SSD)
    sock = node.connect()
    sock.sendall(frame[:len(frame) // 2])
    wait_until(lambda: _find(seg_file, torn[:4096]) >= 0, 10, what="part of the torn payload on disk")
    node.proc.kill()
    node.proc.wait()
    sock.close()
    at = _find(seg_file, damaged[:4096])
    with open(seg_file, "r+b") as f:  # flip one payload byte of a stored object
        f.seek(at + 1000)
        byte = f.read(1)
        f.seek(at + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))

    again = nodes(*args)
    inv = inventory(again)
    assert set(inv) == {(key.decode(), 7) for key, _ in kept}
    assert all(entry["tiers"] == ["ssd"] for entry in inv.values())
    assert 0 < inv[("ttl", 7)]["ttl_ms"] <= 600_000 and inv[("tiny", 7)]["ttl_ms"] == 0
    for key, data in kept:
        assert get(again, key, 7, len(data)) == (Code.OK, data)
    assert get(again, b"damaged", 7, len(damaged))[0] == Code.NOT_FOUND
    assert get(again, b"torn", 7, len(torn))[0] == Code.NOT_FOUND
    assert report(again)["evicted"] == [["damaged", 7]]
    assert "discarding torn object" in again.log()
    assert old_segment and not os.path.exists(old_segment)  # the killed run's /dev/shm file is gone


def test_reads_racing_eviction_get_whole_bytes_or_not_found(nodes, tmp_path):
    node = nodes("--ssd", "6MiB", "--data-dir", str(tmp_path / "d"))
    objs = objects(40, 384 * KiB)  # 15 MiB through 4 MiB DRAM + 6 MiB SSD: demotions and evictions
    written = []
    outcomes = {"ok": 0, "gone": 0, "bad": []}
    done = threading.Event()

    def reader():
        with node.connect() as sock:
            i = 0
            while not done.is_set():
                if not written:
                    continue
                key, data = written[i % len(written)]
                i += 7
                sock.sendall(read_frame(key, 1, len(data)))
                _, _, status, _, payload = read_reply(sock)
                if status == Code.OK:
                    outcomes["ok"] += 1
                    if payload != data:
                        outcomes["bad"].append(key)
                elif status in (Code.NOT_FOUND, Code.STALE):
                    outcomes["gone"] += 1
                else:
                    outcomes["bad"].append((key, status))

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        for key, data in objs:
            put(node, key, 1, data)
            written.append((key, data))
        wait_until(lambda: outcomes["gone"] > 0, 10, what="a read of an evicted object")
    finally:
        done.set()
        for t in threads:
            t.join(10)
    assert outcomes["bad"] == [] and outcomes["ok"] > 0
    tiers = report(node)["tiers"]
    assert tiers["dram"]["demotions"] > 0 and tiers["ssd"]["evictions"] > 0


def test_free_during_a_large_read_defers_until_the_read_ends(nodes):
    node = nodes(dram="16MiB")
    big = os.urandom(10 * MiB)
    put(node, b"big", 1, big)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)  # keep the node's send from finishing
    sock.settimeout(10)
    sock.connect((node.host, node.port))
    auth.handshake_blocking(sock, auth.Credential.for_member(os.environ["KVPOOL_TOKEN"]), "node")
    try:
        sock.sendall(read_frame(b"big", 1, len(big)))
        first = sock.recv(64 * KiB)  # the transfer is under way
        assert first
        assert free(node, b"big", 1) == Code.OK
        assert get(node, b"big", 1, len(big))[0] == Code.NOT_FOUND  # gone for new readers at once
        dram = report(node)["tiers"]["dram"]
        assert dram["objects"] == 0 and dram["used"] >= len(big)  # but its bytes stay until the read ends
        status, _ = write_status(node, b"other", 2, os.urandom(10 * MiB))
        assert status == Code.NO_SPACE  # the space is not reusable yet
        rest = bytearray(first)
        while len(rest) < wire.REPLY.size + len(big):
            chunk = sock.recv(1 * MiB)
            assert chunk
            rest += chunk
        assert bytes(rest[wire.REPLY.size:]) == big
    finally:
        sock.close()
    wait_until(lambda: report(node)["tiers"]["dram"]["used"] == 0, 10, what="deferred free")
    put(node, b"other", 2, os.urandom(10 * MiB))
