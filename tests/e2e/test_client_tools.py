"""`kvpool bench --compress` and `kvpool status` against a running cluster."""

import json
import re
import subprocess
import sys

KVPOOL = [sys.executable, "-m", "kvpool.commands.cli"]


def test_bench_with_compression_reports_ratio_and_codec_time(cluster):
    result = subprocess.run([*KVPOOL, "bench", "--master", cluster.master_address, "--sizes", "64KiB,1MiB",
                             "--batch", "4", "--seconds", "0.2", "--compress"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {(r["op"], r["size"]) for r in report["results"]} == {
        (op, size) for op in ("put", "get", "get_into", "batch_put", "batch_get_into", "batch_get_into_offsets",
                              "batch_get_into_parts")
        for size in (65536, 1 << 20)} | {
        ("put_fresh", 65536), ("put_fresh", 1 << 20), ("put_from_fresh", 1 << 20), ("batch_put_from_fresh", 1 << 20)}
    assert all(r["MBps"] > 0 for r in report["results"])
    costs = report["compression"]["sizes"]
    assert [c["size"] for c in costs] == [65536, 1 << 20]
    for cost in costs:
        assert cost["ratio"] > 2 and cost["stored"] * cost["ratio"] >= cost["size"] * 0.99
        assert cost["compress_us"] > 0 and cost["decompress_us"] > 0
    assert "ratio" in result.stderr


def test_status_shows_each_tier_with_its_counters(cluster, client):
    client.put("status/k", b"v" * 1000)
    client.get("status/k")
    result = subprocess.run([*KVPOOL, "status", "--master", cluster.master_address],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^NODE\s+ADDRESS\s+TIER\s+CAPACITY\s+USED\s+USED%\s+OBJECTS\s+HITS\s+MISSES\s+DEMOTED"
                     r"\s+PROMOTED\s+EVICTED\s+WATERMARK", result.stdout, re.M), result.stdout
    assert len(re.findall(r"^node-\d+\s+127\.0\.0\.1:\d+\s+DRAM\s+192MiB", result.stdout, re.M)) == 2
    client.remove("status/k")
