"""The transformers handoff demo against a real cluster: prefill and decode in separate processes, the KV carried
only by kvpool, and decode's greedy tokens equal to a run that computes everything."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import Client

pytest.importorskip("transformers")

DEMO = Path(__file__).resolve().parents[2] / "examples" / "transformers_handoff" / "handoff.py"


def test_decode_loads_the_prefill_kv_and_generates_the_same_tokens(cluster):
    done = subprocess.run([sys.executable, str(DEMO), "--master", cluster.master_address, "--repeats", "1",
                           "--new-tokens", "8"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])

    assert report["tokens_identical"] is True
    assert report["requests"] == report["identical_requests"] == 2
    block = report["block_size"]
    for prompt, loaded, computed in zip(report["prompt_tokens"], report["prompt_tokens_loaded"],
                                        report["prompt_tokens_computed"]):
        # Every full block but the one holding the last token comes from kvpool; decode computes less than a block.
        assert loaded == (prompt - 1) // block * block > 0
        assert loaded + computed == prompt and computed < block

    # Prefix reuse: the first prefill computes everything, the second (another process) loads the shared
    # system prompt's full blocks and stores only the blocks after it.
    first, second = report["prefill_tokens_loaded"]
    assert first == 0 and second > 0 and second % block == 0
    assert report["prefill_tokens_computed"][1] == report["prompt_tokens"][1] - second
    stored_first, stored_second = report["bytes_stored_per_request"]
    assert 0 < stored_second < stored_first

    # What decode moved is exactly the K and V of the blocks it loaded.
    block_bytes = stored_first // (report["prompt_tokens"][0] // block)
    assert report["bytes_loaded_per_request"] == [n // block * block_bytes for n in report["prompt_tokens_loaded"]]
    assert all(ms > 0 for ms in report["ttft_ms_loaded"] + report["ttft_ms_computed"])

    with Client(cluster.master_address) as client:  # the demo leaves none of its blocks behind
        assert client.remove_prefix(report["namespace"]) == 0
