"""`kvpool status` rendering of a Stats reply: one row per tier of each node."""

import re

from kvpool.proto import kvpool_pb2 as pb
from kvpool.commands.status import render_status

MiB = 1 << 20


def _stats() -> pb.StatsResponse:
    return pb.StatsResponse(
        master_id="m1", address="127.0.0.1:5000", version="0.2.0", wire_protocol=3, objects=12, bytes=30 * MiB, pending_puts=1,
        hits=3, misses=1, puts=14, removes=2, reclaimed_puts=0,
        nodes=[
            pb.NodeStats(node_id="node-1", address="127.0.0.1:6001", transports=["tcp"], version="0.2.0", tiers=[
                pb.TierStats(tier=pb.SSD, capacity=256 * MiB, used=64 * MiB, objects=8, hits=40, misses=2,
                             promotions=3, evictions=5, watermark="normal"),
                pb.TierStats(tier=pb.DRAM, capacity=32 * MiB, used=30 * MiB, objects=4, hits=100, misses=7,
                             demotions=9, watermark="high"),
            ]),
            pb.NodeStats(node_id="node-0", address="127.0.0.1:6000", transports=["tcp"], tiers=[
                pb.TierStats(tier=pb.DRAM, capacity=32 * MiB, used=0, objects=0),
            ]),
        ])


def test_every_tier_of_every_node_gets_a_row_with_its_counters():
    text = render_status(_stats())
    lines = text.splitlines()
    assert lines[0].startswith("master 127.0.0.1:5000 (m1): 2 nodes, 12 objects")
    assert "hit rate 75.0%" in lines[1]
    assert lines[2].startswith("replica health: 0 objects below their copy target")
    # mid-upgrade: node-0 of a release that names none
    assert lines[3] == "releases: master 0.2.0 (wire protocol 3); nodes 0.2.0 on 1, unknown on 1"
    header = lines[5].split()
    assert header == ["NODE", "ADDRESS", "TIER", "CAPACITY", "USED", "USED%", "OBJECTS", "HITS", "MISSES",
                      "DEMOTED", "PROMOTED", "EVICTED", "WATERMARK", "TRANSPORTS"]
    rows = [line.split() for line in lines[6:]]
    assert [row[:3] for row in rows] == [["node-0", "127.0.0.1:6000", "DRAM"],  # nodes sorted, DRAM first
                                         ["node-1", "127.0.0.1:6001", "DRAM"],
                                         ["node-1", "127.0.0.1:6001", "SSD"]]
    assert rows[1][3:] == ["32MiB", "30MiB", "93.8", "4", "100", "7", "9", "0", "0", "high", "tcp"]
    assert rows[2][3:] == ["256MiB", "64MiB", "25.0", "8", "40", "2", "0", "3", "5", "normal", "tcp"]
    assert rows[0][5] == "0.0" and rows[0][12] == "-"  # no watermark reported yet
    assert re.search(r"node-0\s+127\.0\.0\.1:6000\s+DRAM\s+32MiB", text)


def test_the_shared_tier_gets_a_line_only_when_a_node_mounts_one():
    assert "shared tier" not in render_status(_stats())
    stats = _stats()
    stats.shared.CopyFrom(pb.SharedTierStats(capacity=2048 * MiB, used=512 * MiB, objects=100, servers=2))
    lines = render_status(stats).splitlines()
    assert lines[4] == "shared tier: 100 objects, 512MiB of 2GiB (25.0%), served by 2 nodes"


def test_a_failing_disk_gets_a_line_naming_the_node_the_tier_and_why():
    assert "fails" not in render_status(_stats())
    stats = _stats()
    stats.nodes[0].tiers[0].fault = "EIO: Input/output error"
    stats.nodes[1].shared_fault = "a call did not answer within 10s"
    lines = render_status(stats).splitlines()
    assert lines[4:6] == ["node-1 SSD fails, skipped until it answers: EIO: Input/output error",
                          "node-0 shared tier fails, skipped until it answers: a call did not answer within 10s"]
