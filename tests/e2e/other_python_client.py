"""Run by test_other_pythons.py under another Python (a venv with this checkout installed): a local cluster started
by that Python, and the blocking Client's calls on it, both the ones stepped by hand with no event loop
(kvpool/runtime/coroutine_driver.py) and the ones that go on to its loop (shared memory, a deadline, a hold the
master waits out in a task of its control port). Prints one JSON line; an assertion that fails exits non-zero."""

import asyncio
import json
import sys

import kvpool
from kvpool import AsyncClient, Client
from kvpool.errors import KeyNotFoundError
from kvpool.launch.local_cluster import LocalCluster

from test_blocking_lookups import LoopWatch


def main(data_dir: str) -> dict:
    with LocalCluster(nodes=2, dram_per_node="64MiB", data_dir=data_dir, lease_ttl=2, put_timeout=3) as cluster:
        with Client(cluster.master_address, transports="tcp") as client:
            warm = [f"py/warm{i}" for i in range(8)]
            client.batch_put(warm, [b"w" * 100] * 8)  # the first connections, on the loop
            assert client.batch_get(warm) == [b"w" * 100] * 8
            keys = [f"py/{i}" for i in range(8)]
            values = [bytes([i]) * 4096 for i in range(8)]
            with LoopWatch() as watch:  # each step by hand, none on the loop
                client.put("py/one", b"x" * 5000)
                assert client.get("py/one") == b"x" * 5000
                assert client.get("py/one", timeout=5) == b"x" * 5000
                client.batch_put(keys, values)  # spread over both nodes, one after the other
                assert client.batch_get(keys + ["py/missing"]) == values + [None]
                assert client.exists("py/one") and not client.exists("py/never")
                assert client.batch_exists(["py/one", "py/never"]) == [True, False]
            by_hand_loop_runs = watch.entered
            assert client.exists("py/one", hold=1.0)  # the master asks a node to hold it: a task resumes the call
            assert client.remove("py/one")
            try:
                client.get("py/one")
                raise AssertionError("a removed key was read")
            except KeyNotFoundError:
                pass
        with Client(cluster.master_address, transports="shm") as client:
            client.put("py/shm", b"s" * 70000)  # the mapping and its ring wait on the loop
            assert client.get("py/shm") == b"s" * 70000
            assert client.batch_get(keys) == values

        async def on_a_loop():
            async with AsyncClient(cluster.master_address) as aclient:
                await aclient.put("py/async", b"a" * 1000)
                return await aclient.get("py/async")

        assert asyncio.run(on_a_loop()) == b"a" * 1000
    return {"python": ".".join(map(str, sys.version_info[:3])), "kvpool": kvpool.__file__,
            "by_hand_loop_runs": by_hand_loop_runs}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
