"""The KV-aware routing service against a real cluster's block stream and an engine's KV events over ZMQ, asked
over HTTP."""

import json
import os
import time
import urllib.error
import urllib.request

import msgspec
import pytest
import zmq

from kvpool import Client
from kvpool.connectors.block_keys import BlockNamespace, block_hashes
from kvpool.connectors.routing_service import RoutingService
from kvpool.net.netutil import wait_until
from kvpool.security import auth

BS = 4
NAMESPACE = BlockNamespace("router-test", "float32", "vllm-nhd", BS)


def post(port: int, path: str, body, token: str | None = None) -> tuple[int, dict]:
    """POST `body` with `token` as the bearer token (None: the cluster's client token; "": none)."""
    token = auth.client_token(os.environ["KVPOOL_TOKEN"]) if token is None else token
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                     method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_routes_by_the_engines_caches_and_the_pool(cluster):
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    prompt = list(range(4 * BS)) + [7]
    hashes = block_hashes(prompt[:4 * BS], BS)
    seq = 0

    def publish_first_block():  # engine "a" holds the prompt's first block (a PUB drops what comes before a SUB)
        nonlocal seq
        event = {"type": "BlockStored", "block_hashes": [b"e1"], "parent_block_hash": None,
                 "token_ids": prompt[:BS], "block_size": BS, "lora_id": None, "medium": "CPU", "lora_name": None}
        pub.send_multipart([b"", seq.to_bytes(8, "big"), msgspec.msgpack.encode([time.time(), [event], None])])
        seq += 1

    with RoutingService({"a": f"tcp://127.0.0.1:{port}", "b": ""}, NAMESPACE,
                        master=cluster.master_address) as service, Client(cluster.master_address) as client:
        http = service.serve_http()
        client.batch_put([NAMESPACE.key(h) for h in hashes[:3]], [b"kv"] * 3)  # the pool holds three blocks

        def informed():
            state = service.state()
            if state["a"]["blocks"] == 0:
                publish_first_block()
            return state["pool_blocks"] == 3 and state["a"]["blocks"] == 1

        wait_until(informed, 20, what="the router to follow the pool and engine a")
        status, answer = post(http, "/route", {"token_ids": prompt})
        assert status == 200 and answer["engine"] == "a"  # 1 local + 0.8 × 2 pool beats 0.8 × 3
        by = {s["engine"]: s for s in answer["scores"]}
        assert (by["a"]["local_blocks"], by["a"]["pool_blocks"], by["b"]["local_blocks"]) == (1, 3, 0)
        # "a" is busy with it now: the same prompt goes to "b", which loads the pool's three blocks.
        assert post(http, "/route", {"token_ids": prompt})[1]["engine"] == "b"
        assert (service.state()["a"]["in_flight"], service.state()["b"]["in_flight"]) == (1, 1)
        assert post(http, "/finished", {"engine": "a"})[0] == 200
        assert service.state()["a"]["in_flight"] == 0
        assert post(http, "/route", {"token_ids": "not tokens"})[0] == 400
        assert post(http, "/nowhere", {})[0] == 404
        for refused in ("", "kvpool-client-v1:" + "00" * 32, os.environ["KVPOOL_TOKEN"]):  # none, wrong, the secret
            status, answer = post(http, "/route", {"token_ids": prompt}, token=refused)
            assert status == 401 and "client token" in answer["error"]
        with pytest.raises(urllib.error.HTTPError) as engines:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/engines", timeout=10)
        assert engines.value.code == 401
        assert service.state()["b"]["in_flight"] == 1  # nothing refused was routed
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=10) as ready:
            assert ready.status == 200 and json.loads(ready.read()) == {"ok": True}
        client.remove_prefix(NAMESPACE.prefix())
        wait_until(lambda: service.state()["pool_blocks"] == 0, 20, what="the router to see the blocks go")
    pub.close()
    context.term()
