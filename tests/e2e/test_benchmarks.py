"""The scripts under benchmarks/, run as a user runs them, on a small workload. (hostile_peers.py runs in
test_hostile_peers.py; vllm_transfer.py needs a real vLLM engine and its venv, which is what tests/engines is for.)"""

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


def test_trace_replay_over_the_object_tier_models_time_to_first_token(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _conversation_trace(trace)
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "trace_replay.py"), "--trace", str(trace),
                             "--requests", "50", "--block-bytes", "32KiB", "--pool", "2MiB", "--object-store", "local",
                             "--shared-capacity", "8MiB", "--direct", "--miss-cost", "20"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["settings"]["deep_tier"] == "bucket" and report["shared_tier"]["capacity"] == 8 << 20
    # (a pool this small evicts blocks between a request's lookup and its load: hits lost, never wrong bytes)
    assert report["wrong_blocks"] == 0 and report["failed_saves"] == 0
    ttft = report["modelled_ttft_ms"]
    assert ttft["miss_cost_ms"] == 20 and 0 < ttft["p50"] <= ttft["p90"]
    # a request with every block missed waits its blocks' compute: the longest chain here has 15 blocks
    assert ttft["p90"] >= 20


def _run(script: str, *args: str, timeout: float = 240) -> dict:
    """Run benchmarks/SCRIPT as a user does; its last line, a JSON object."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args], capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _latency(row: dict, samples: int) -> None:
    assert row["samples"] == samples and 0 < row["p50_us"] <= row["p99_us"], row


def test_control_latency_measures_every_call_and_the_socket_floor():
    report = _run("control_latency.py", "--samples", "50")
    assert set(report) == {"socket_round_trip_64B", "put_64KiB_fresh", "batch_exists_32", "exists",
                           "hand_sent_batch_exists_32", "hand_sent_batch_exists_32_after_posted_put_end_22",
                           "socket_round_trip_64B_after"}
    for row in report.values():
        _latency(row, 50)
    # A master call rides on a socket round trip: the bare round trip is its floor.
    floor = min(report["socket_round_trip_64B"]["p50_us"], report["socket_round_trip_64B_after"]["p50_us"])
    assert floor < report["exists"]["p50_us"] <= report["put_64KiB_fresh"]["p99_us"]
    assert floor < report["hand_sent_batch_exists_32"]["p50_us"]
    # The master's CPU per call comes from its process accounting, in ticks of 10 ms: 50 calls may read 0.
    for name in ("batch_exists_32", "hand_sent_batch_exists_32", "hand_sent_batch_exists_32_after_posted_put_end_22"):
        assert 0 <= report[name]["master_cpu_us"] < 100_000, report[name]


def test_ucx_raw_times_ucx_and_tcp_against_the_same_node():
    report = _run("ucx_raw.py", "--tls", "tcp", "--rounds", "2")
    assert report["unit"] == "MB/s" and set(report) == {"unit", "tcp"}  # one UCX_TLS setting asked
    ops = {"read_into_4MiB", "read_many_64x1MiB", "write_4MiB", "write_many_64x1MiB"}
    for transport in ("ucx", "tcp"):
        assert set(report["tcp"][transport]) == ops and all(v > 0 for v in report["tcp"][transport].values())


def test_zipf_prefix_fills_both_tiers_and_reads_each():
    report = _run("zipf_prefix.py", "--dram", "8MiB", "--ssd", "32MiB", "--data-factor", "3", "--block", "64KiB",
                  "--requests", "200", "--max-blocks", "40")
    workload = report["workload"]
    assert workload["requests"] == 200 and 0 < workload["block_hit_rate"] <= 1
    assert workload["unique_MiB"] > 8  # more than DRAM holds: the SSD tier is used
    tiers = report["tiers_after_replay"]
    assert tiers["DRAM"]["demotions"] > 0 and tiers["SSD"]["used"] > 0
    assert 0 < tiers["DRAM"]["used"] <= tiers["DRAM"]["capacity"]
    # Read once the master has a report of the node asked after the replay: every block the replay loaded
    # was served by one tier and is counted there (a report from during the replay shows only some).
    assert tiers["DRAM"]["hits"] + tiers["SSD"]["hits"] >= workload["blocks_found"] > 0, (tiers, workload)
    for phase in ("get_from_dram", "get_from_ssd"):
        assert report[phase]["blocks"] > 0 and report[phase]["MBps"] > 0, phase
    # Blocks the inventories placed on SSD only are all served from SSD (read once each: none promoted).
    assert report["get_from_ssd"]["served_by"]["SSD"] == 1.0


def test_scale_writes_every_object_and_loses_none_over_a_leader_kill():
    report = _run("scale.py", "--objects", "3000", "--batch", "500", "--deadline", "60")
    assert report["objects"] == report["objects_counted"] == 3000
    assert report["lost"] == 0 and report["sample_wrong"] == 0
    assert 0 < report["first_put_s"] <= report["all_keys_back_s"] < 60
    assert report["put_objects_per_s"] > 0 and report["leader_rss_bytes_per_object"] is not None


def test_chaos_loses_nothing_committed_over_a_node_and_a_leader_kill():
    report = _run("chaos.py", "--clients", "1", "--phase-seconds", "1")
    assert report["node_kill"]["dropped_after_s"] is not None and report["node_kill"]["repaired_after_s"] is not None
    assert report["leader_kill"]["new_leader_after_s"] is not None
    assert report["clients_up_after_s"] is not None and report["leader_kill"]["puts_served_after_s"] is not None
    assert report["committed"] > 0 and report["lost"] == 0
    assert report["phases"]["after_leader_kill"]["puts"] > 0  # served again after the failover
    assert all(phase["wrong"] == 0 for phase in report["phases"].values())


def test_tenants_keeps_a_reserved_tenants_hits_under_another_tenants_flood(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _conversation_trace(trace, requests=300)
    report = _run("tenants.py", "--trace", str(trace), "--requests", "300", "--block-bytes", "4KiB",
                  "--pool", "8MiB", "--a-quota", "6MiB", "--flood-block", "128KiB", "--runs", "1")
    [run] = report["runs"]
    assert report["ok"], run
    assert run["b_hit_vs_alone_with_reserve"] >= 0.9 and run["alone"]["b"]["hit_ratio"] > 0
    for name in ("flood_with_reserve", "flood_without_reserve"):
        flood = run[name]["a"]
        assert flood["within_quota"] and flood["flooded_bytes"] >= 10 * (8 << 20), flood
        assert run[name]["b"]["wrong_blocks"] == 0
    assert run["flood_with_reserve"]["a"]["evicted_pressure"] + run["flood_with_reserve"]["a"]["evicted_quota"] > 0


def test_mooncake_shim_runs_the_same_round_through_the_shim_and_the_client():
    report = _run("mooncake_shim.py", "--rounds", "1", "--no-mooncake", "--small-count", "16", "--large-count", "4",
                  "--batches", "1", "--latency-samples", "20", "--segment-mib", "512")
    ops = {"put_64KiB", "get_64KiB", "put_4MiB", "get_4MiB", "batch_put_from_64x1MiB", "batch_get_into_64x1MiB",
           "get_64KiB_p50_us"}
    assert set(report["median"]) == {"client", "shim"} and set(report["ratio_median"]) == {"shim_vs_client"}
    for side in ("client", "shim"):
        assert set(report["median"][side]) == ops and all(v > 0 for v in report["median"][side].values())
    assert all(ratio > 0 for ratio in report["ratio_median"]["shim_vs_client"].values())


def test_object_tier_measures_kvpool_against_its_client_library():
    report = _run("object_tier.py", "--rounds", "1", "--scale", "0.05")
    assert set(report["sizes"]) == {"32KiB", "1MiB", "32MiB"}
    for size in report["sizes"].values():
        assert set(size["median"]) == {"obstore", "kvpool"}
        assert set(size["median"]["kvpool"]) == {"put", "get_through_node", "get_direct"}
        assert all(ratio > 0 for ratio in size["ratio_median"].values())


def test_shared_scan_adopts_a_bucket_run_of_batch_manifests_and_its_fold():
    report = _run("shared_scan.py", "--object-store", "local", "--records", "5000", "--records-per-manifest", "32")
    assert report["store"] == "bucket" and report["records"] == 5000 and report["manifest_objects"] == 158
    assert 0 < report["live"] < 5000 - report["superseded"] - report["expired"]  # less what was removed
    assert report["manifests_after_fold"] == 1 and report["after_fold_seconds"] > 0 and report["fold_seconds"] > 0
