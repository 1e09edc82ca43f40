"""The engine connectors, run against the engines themselves.

Each engine lives in its own venv (examples/engine_venvs.py builds it on first use, a few minutes each, then
reuses it), so these tests drive it from outside: the LMCache and SGLang tests run the in_<engine>.py files with
the engine venv's pytest (they use this suite's fixtures, real clusters included), and the vLLM test runs the
prefill/decode example end to end against a cluster of this module.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "examples"))

from engine_venvs import ensure  # noqa: E402

from kvpool.net.netutil import wait_until  # noqa: E402

BUILD_AND_RUN = 1800  # seconds: building an engine venv from nothing is most of it


def run_inside(engine: str, test_file: str):
    python = ensure(engine)
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert run.returncode == 0, run.stdout[-6000:]
    assert " passed" in run.stdout.splitlines()[-1] and "skipped" not in run.stdout.splitlines()[-1]


@pytest.mark.timeout(BUILD_AND_RUN)
def test_lmcache_remote_backend_through_lmcache_own_backends():
    run_inside("lmcache", "tests/engines/in_lmcache.py")


@pytest.mark.timeout(BUILD_AND_RUN)
def test_sglang_hicache_storage_through_sglang_own_pools():
    run_inside("sglang", "tests/engines/in_sglang.py")


@pytest.mark.timeout(BUILD_AND_RUN)
def test_lmcache_own_mooncakestore_backend_runs_unchanged_on_kvpool():
    run_inside("lmcache", "tests/engines/in_lmcache_mooncake.py")


@pytest.mark.timeout(BUILD_AND_RUN)
def test_sglang_own_mooncake_backend_runs_unchanged_on_kvpool():
    run_inside("sglang", "tests/engines/in_sglang_mooncake.py")


@pytest.mark.timeout(BUILD_AND_RUN)
def test_vllm_prefill_decode_disaggregation_and_prefix_reuse(cluster):
    """Three vLLM processes (baseline, prefill, decode): decode loads what prefill stored, including the
    system prompt another request computed, computes a prompt whose stored blocks are junk, loads a
    conversation's second turn including the first turn's answer, and its greedy tokens equal the baseline's."""
    ensure("vllm")
    run = subprocess.run([sys.executable, "examples/vllm_disaggregation/run.py", "--master",
                          cluster.master_address, "--json-only"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert run.returncode == 0, run.stderr[-6000:] + run.stdout[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["tokens_identical"] and summary["requests_compared"] == 6  # 4 requests and 2 turns
    # D's two blocks were junk when decode looked them up: found, refused at load, reported, computed instead.
    assert summary["damaged_D"] == {"prompt_tokens": 286, "blocks_failed": 2, "bytes_loaded": 0}
    block = 128
    # Every full block before each prompt's last token came from kvpool: 4 + 4 + 3 blocks.
    assert summary["prompt_tokens_loaded"] == 11 * block
    assert summary["prefix_reuse_B"] == {"prompt_tokens": 592, "loaded": 4 * block}
    assert summary["vllm_external_prefix_cache"]["vllm:external_prefix_cache_hits"] >= 11 * block
    loaded = summary["bytes_loaded_per_request"]
    per_block = loaded["C"] // 3
    assert per_block > 0 and loaded == {"B": 4 * per_block, "A": 4 * per_block, "C": 3 * per_block}
    assert summary["bytes_saved_per_request"] == {"A": 4 * per_block, "C": 3 * per_block}
    # The second turn of a conversation loads the blocks the first turn's answer filled, not only its prompt's:
    # 276 prompt + 266 answer tokens are 4 full blocks, 2 of them written with generated tokens.
    turn = summary["second_turn"]
    assert turn["blocks_saved_by_first_turn"] == 4 and turn["loaded"] == 4 * block > turn["first_turn_prompt_tokens"]


@pytest.mark.timeout(BUILD_AND_RUN)
def test_vllm_loads_a_prompt_from_the_shared_tier_of_a_cluster_started_after_its_own_was_killed():
    """The shared-tier example: a prompt's blocks, saved by one vLLM engine, pushed into the shared directory by
    other traffic, survive every node and master of their cluster being killed; a new cluster over the directory
    finds them and another engine loads them, its greedy tokens equal to the baseline's."""
    ensure("vllm")
    run = subprocess.run([sys.executable, "examples/vllm_shared_tier/run.py", "--json-only"], cwd=REPO,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert run.returncode == 0, run.stderr[-6000:] + run.stdout[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["tokens_identical"]
    block = 128
    # Every full block before the prompt's last token came from the shared tier: 6 of 818 tokens' blocks.
    full_blocks = (summary["prompt_tokens"] - 1) // block
    assert full_blocks == summary["prompt_blocks"] == 6
    assert summary["prompt_tokens_loaded"] == full_blocks * block
    assert summary["blocks_saved"] == summary["blocks_in_shared_tier_before_restart"] == full_blocks
    assert summary["blocks_found_after_restart"] == summary["blocks_loaded"] == full_blocks
    assert summary["blocks_failed"] == 0 and summary["bytes_loaded"] == full_blocks * (1 << 20)
    # The new cluster adopted all the directory held (the sweep may have moved more there after it was counted).
    before, adopted = summary["shared_tier_before_restart"], summary["shared_tier_adopted"]
    assert adopted["objects"] >= before["objects"] >= full_blocks and adopted["bytes"] >= before["bytes"]
    assert summary["adoption_s"] is not None


@pytest.mark.timeout(BUILD_AND_RUN)
def test_vllm_kv_events_name_blocks_as_kvpool_does():
    """A real vLLM engine's KV events, followed by the router, name every block it cached as kvpool's chained
    prefix hash does (prompt and generated tokens alike), and its cache reset empties the view."""
    python = ensure("vllm")
    run = subprocess.run([str(python), "tests/engines/in_vllm_events.py"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert run.returncode == 0, run.stderr[-6000:] + run.stdout[-2000:]
    # vLLM logs to stdout as well: the result is the line that is a JSON object
    result = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    # 424 prompt + 256 generated tokens: 5 full blocks of 128 whose KV was computed.
    assert result["named"] == result["expected_blocks"] == 5 and result["extra"] == 0 and result["gaps"] == 0
    assert result["golden_prompt_blocks_named"] == 3  # the prompt's blocks under their written-down names
    assert result["after_reset"] == 0


@pytest.mark.timeout(BUILD_AND_RUN)
@pytest.mark.parametrize("transfer", ["async", "sync"])
def test_vllm_loads_give_identical_tokens_and_survive_a_node_killed_before_loading(own_cluster, tmp_path, transfer):
    """Both transfer modes: loaded blocks give the computed run's tokens; a storage node killed between the
    lookup and the load loses its blocks, vLLM computes them, and the tokens are still identical."""
    python = ensure("vllm")
    cluster = own_cluster(2)
    engine = subprocess.Popen([str(python), "tests/engines/in_vllm_transfer.py", "--master", cluster.master_address,
                               "--transfer", transfer, "--rendezvous", str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        paused = tmp_path / "paused"
        wait_until(lambda: paused.exists() or engine.poll() is not None, 600, what="the engine to reach its load")
        assert engine.poll() is None, engine.communicate()[1][-6000:]
        keys = json.loads(paused.read_text())
        holders = replica_addresses(cluster, keys)
        # Kill a node holding a later block if one does not hold the first (some blocks load, the rest are
        # computed); otherwise the first block's node (none load).
        later = [address for address in holders[1:] if address != holders[0]]
        victim = later[0] if later else holders[0]
        next(node for node in cluster.nodes if node.info["address"] == victim).kill()
        (tmp_path / "go").write_text("")
        out, err = engine.communicate(timeout=600)
    finally:
        if engine.poll() is None:
            engine.kill()
    assert engine.returncode == 0, err[-6000:] + out[-2000:]
    result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    first, second = result["first"], result["second"]
    assert first["identical"] and first["blocks_loaded"] == first["stored_blocks"] == 5
    assert second["identical"] and second["stored_blocks"] == 6
    assert second["blocks_loaded"] == holders.index(victim) and second["blocks_failed"] == 6 - holders.index(victim)
    # vLLM's own metrics, fed by the connector's KVConnectorStats, count what the connector reported per request.
    stats, per_request = result["vllm_stats"], result["per_request"]
    assert stats["blocks_loaded"] == first["blocks_loaded"] + second["blocks_loaded"] == per_request["blocks_loaded"]
    assert stats["bytes_loaded"] == per_request["bytes_loaded"] > 0 and stats["loads"] == 2
    assert stats["blocks_failed"] == second["blocks_failed"] == per_request["blocks_failed"]
    # Saves: every stored block, async ones included (they are counted once done, after their request returned).
    per_block = per_request["bytes_loaded"] // per_request["blocks_loaded"]
    assert stats["blocks_saved"] == first["stored_blocks"] + second["stored_blocks"] == 11
    assert stats["bytes_saved"] == 11 * per_block and stats["blocks_save_failed"] == 0


# Per model: KV cache groups, and blocks each group loads for the prompt (in_vllm_hybrid.py: 5 blocks of 128 for
# gemma3, 2 of 384 for qwen3next): a window of 128 tokens needs the last block, a state the last one's state.
HYBRID = {"gemma3": {"g0": 1, "g1": 1, "g2": 5}, "qwen3next": {"g0": 1, "g1": 2}}


@pytest.mark.timeout(BUILD_AND_RUN)
@pytest.mark.parametrize("model", sorted(HYBRID))
def test_vllm_hybrid_model_saved_by_one_engine_and_loaded_by_another(cluster, tmp_path, model):
    """A hybrid model (sliding window + full attention; linear-attention state + full attention) with vLLM's
    hybrid KV cache manager on: one engine saves a prompt, every group of it; another loads each group's part
    with one lookup, its greedy tokens equal to the first's; and a group's stored blocks replaced by junk change
    the tokens (that group's loaded KV is really used)."""
    python = ensure("vllm")

    def engine(role: str) -> dict:
        run = subprocess.run([str(python), "tests/engines/in_vllm_hybrid.py", "--master", cluster.master_address,
                              "--model", model, "--role", role, "--workdir", str(tmp_path)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert run.returncode == 0, run.stderr[-6000:] + run.stdout[-2000:]
        return json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])

    saved, loaded = engine("save"), engine("load")
    loads = HYBRID[model]
    assert saved["groups"] == loaded["groups"] == len(loads)  # the hybrid manager is on: several groups
    assert saved["moved"].get("blocks_loaded", 0) == 0 and saved["stored_per_group"] == (
        [5, 5, 5] if model == "gemma3" else [1, 2])  # a state group keeps the state at the prompt's last boundary
    assert loaded["tokens"] == saved["tokens"] and loaded["lookups"] == 1
    assert {k.removeprefix("blocks_loaded_"): v for k, v in loaded["moved"].items()
            if k.startswith("blocks_loaded_g")} == loads
    assert loaded["moved"]["blocks_failed"] == 0 and loaded["moved"]["blocks_loaded"] == sum(loads.values())
    partial = {group for group in loads if loads[group] < max(loads.values())}
    assert {f"g{n}" for n in loaded["corrupted"]} == partial
    for group, damaged in loaded["corrupted"].items():
        assert damaged["tokens_changed"] and damaged["blocks_loaded"] == loads[f"g{group}"], (group, damaged)
    assert loaded["restored_identical"] and loaded["restored_moved"]["blocks_loaded"] == sum(loads.values())


@pytest.mark.timeout(BUILD_AND_RUN)
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="tensor parallelism 2 binds a worker to each of two cores")
def test_vllm_tensor_parallel_ranks_store_one_copy_of_replicated_kv(cluster):
    """vLLM at tensor parallelism 2: one KV head, replicated on both ranks (as MLA's latent is on every rank), is
    stored once, written by rank 0 and loaded by both, with one lookup per request, and the loaded run's greedy
    tokens equal the computed run's. (Heads split across ranks, a shard each: tests/unit/test_kv_groups.py;
    in_vllm_tp.py --kv-heads 2 runs that case in the engine.)"""
    kv_heads, shards = 1, 1
    python = ensure("vllm")
    run = subprocess.run([str(python), "tests/engines/in_vllm_tp.py", "--master", cluster.master_address,
                          "--kv-heads", str(kv_heads)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert run.returncode == 0, run.stderr[-6000:] + run.stdout[-2000:]
    result = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    assert len(result["stored"]) == shards and set(result["stored"].values()) == {result["blocks"]} == {4}
    assert all(f"rank{n}of{shards}/" in "".join(result["stored"]) for n in range(shards))
    assert result["identical"] and result["lookups"] == 1 and result["blocks_failed"] == 0
    assert result["blocks_loaded"] == 2 * result["blocks"]  # both ranks loaded every block


def replica_addresses(cluster, keys: list[str]) -> list[str]:
    """The node holding each key (one replica each)."""
    from kvpool import Client
    from kvpool.client import convert

    with Client(cluster.master_address) as client:
        infos = [client._core.master.call_now(*convert.lookup_call([key])).object for key in keys]
    return [info.replicas[0].address for info in infos]


@pytest.mark.timeout(BUILD_AND_RUN)
def test_kv_routing_example_two_engines_behind_the_router(cluster, tmp_path):
    """The routing example, small: two vLLM engines publishing KV events, four policies, every output equal to
    the engines-without-kvpool run's; the router sends turns where their prefix is, and kvpool's blocks are
    loaded by whichever engine did not compute them."""
    ensure("vllm")
    trace = tmp_path / "trace.jsonl"  # the shared trace's format (it is not part of the repository)
    with open(trace, "w") as out:
        # 7 conversations of 3 turns, interleaved; the example takes the first 5 whole (an odd count, so that
        # round-robin sends a conversation's turns to both engines); all share block 0, a system prompt.
        for i in range(21):
            conversation, turn = i % 7, i // 7
            chain = [0] + [100 * (conversation + 1) + b for b in range(2 * turn + 2)]
            out.write(json.dumps({"timestamp": i, "input_length": 512 * len(chain), "output_length": 8,
                                  "hash_ids": chain}) + "\n")
    run = subprocess.run([sys.executable, "examples/kv_routing/run.py", "--master", cluster.master_address,
                          "--requests", "15", "--trace", str(trace), "--json-only"], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert run.returncode == 0, run.stderr[-6000:] + run.stdout[-2000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    policies = ("no_kvpool", "kv_aware_local", "round_robin", "kv_aware")
    assert all(summary[p]["identical_tokens"] and summary[p]["requests"] == 15 for p in policies)
    prompt = summary["workload"]["prompt_tokens"]
    assert all(summary[p]["prompt_tokens"] == prompt for p in policies)
    assert summary["no_kvpool"]["loaded_tokens"] == summary["kv_aware_local"]["loaded_tokens"] == 0
    assert summary["round_robin"]["loaded_tokens"] > 0  # the other engine's turns, from kvpool
    # The same round-robin order computes less with kvpool: what it loaded, the other engine had computed.
    assert summary["round_robin"]["computed_tokens"] < summary["no_kvpool"]["computed_tokens"]
    assert summary["kv_aware"]["computed_tokens"] < summary["no_kvpool"]["computed_tokens"]
    assert summary["kv_aware"]["local_hit_tokens"] > 0 and summary["kv_aware_local"]["local_hit_tokens"] > 0
