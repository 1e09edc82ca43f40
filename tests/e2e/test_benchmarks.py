"""The scripts under benchmarks/, run as a user runs them, on a small workload."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _conversation_trace(path: Path, requests: int = 50) -> None:
    """Lines in the shared trace's format: conversations that share a system prompt (block 0), each turn
    extending its conversation's prefix chain by a few blocks."""
    next_id, chains = 1, []
    with open(path, "w") as out:
        for i in range(requests):
            if i % 5 == 0 or not chains:
                chains.append([0])
            chain = chains[(i * 7) % len(chains)]
            chain.extend(range(next_id, next_id + 3))
            next_id += 3
            out.write(json.dumps({"timestamp": i * 10, "input_length": 512 * len(chain), "output_length": 20,
                                  "hash_ids": chain}) + "\n")


def test_trace_replay_loads_every_stored_prefix_block_intact(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _conversation_trace(trace)
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_replay.py"), "--trace", str(trace),
                             "--requests", "50", "--block-bytes", "4KiB", "--pool", "32MiB"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for field in ("requests_per_s", "blocks_per_s", "hit_ratio", "ideal_lru_hit_ratio", "hit_ratio_vs_lru",
                  "seconds", "wrong_blocks", "failed_saves", "reference"):
        assert field in report, field
    assert report["requests"] == 50
    assert report["wrong_blocks"] == 0 and report["lost_hits"] == 0 and report["failed_saves"] == 0
    assert report["hit_ratio"] > 0
    # The pool holds the whole trace, so nothing is evicted and every block the LRU hits is loaded.
    assert report["hit_ratio"] == report["ideal_lru_hit_ratio"]
    assert report["blocks_loaded"] + report["blocks_saved"] == report["block_references"]
    assert set(report["seconds"]) >= {"lookup", "load", "save"}
    assert report["bytes_by_transport"]["tcp"] > 0
    assert report["reference"]["mooncake"]["requests_per_s"] == 299
