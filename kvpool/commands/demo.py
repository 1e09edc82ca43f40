"""`kvpool up --demo`: a short, verified workload so a new user sees the cluster do real work."""

import os
import time

from ..protocol.checksum import checksum
from ..protocol.units import format_size


def run_demo(master: str, blocks: int = 64, block_size: int = 256 * 1024, token: str | None = None,
             tls_ca: str | None = None) -> None:
    from ..client import Client
    from .status import render_status

    with Client(master, token=token, tls_ca=tls_ca) as client:
        keys = [f"demo/prefix-{i:04d}" for i in range(blocks)]
        values = [os.urandom(block_size) for _ in keys]

        started = time.perf_counter()
        client.batch_put(keys, values, overwrite=True)
        put_s = time.perf_counter() - started
        total = blocks * block_size
        print(f"demo: stored {blocks} KV blocks of {format_size(block_size)} in {put_s * 1000:.1f} ms "
              f"({total / put_s / 1e6:.0f} MB/s)", flush=True)

        started = time.perf_counter()
        got = client.batch_get(keys)
        get_s = time.perf_counter() - started
        wrong = sum(g is None or checksum(g) != checksum(v) for g, v in zip(got, values))
        print(f"demo: loaded them back in {get_s * 1000:.1f} ms ({total / get_s / 1e6:.0f} MB/s), "
              f"{wrong} wrong", flush=True)

        present = sum(client.batch_exists(keys + ["demo/never-stored"]))
        print(f"demo: {present} of {blocks + 1} keys exist (one was never stored)", flush=True)
        print(render_status(client.stats()), flush=True)
        removed = client.remove_prefix("demo/")
        print(f"demo: removed {removed} keys by prefix", flush=True)
        if wrong:
            raise SystemExit(f"demo: {wrong} blocks came back wrong")
