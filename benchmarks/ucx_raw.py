"""Raw data-path throughput of the UCX transport against one storage node, TCP measured alongside.

For each UCX_TLS setting, starts a cluster with one node serving UCX (the node
inherits the setting; the client gets it through UcxTransport's options), then
times, over UCX and over kvpool's TCP transport against the same node (as a member: no leader places
these writes):
read_into of a 4 MiB object, read_many of 64 x 1 MiB, write of 4 MiB and
write_many of 64 x 1 MiB. Needs the extra kvpool[ucx]. Prints one JSON line.

    python benchmarks/ucx_raw.py [--tls tcp --tls posix,cma,self] [--rounds 20]
"""

import argparse
import asyncio
import json
import os
import tempfile
import time

from kvpool.protocol.checksum import checksum
from kvpool.client.tcp import TcpTransport
from kvpool.client.transport import ReadItem, WriteItem
from kvpool.client.ucx import UcxTransport
from kvpool.launch.local_cluster import LocalCluster
from kvpool.security import auth

MiB = 1 << 20
DEFAULT_TLS = ["tcp", "posix,cma,self", ""]  # "": UCX's choice minus cma (kvpool's default)


def start_node(tls: str, data_dir: str) -> LocalCluster:
    """A cluster whose one storage node serves UCX over `tls` ("" = the default)."""
    saved = os.environ.pop("UCX_TLS", None)
    if tls:
        os.environ["UCX_TLS"] = tls
    try:
        return LocalCluster(nodes=1, dram_per_node="512MiB", data_dir=data_dir,
                            node_args=["--transports", "tcp,ucx"]).start()
    finally:
        os.environ.pop("UCX_TLS", None)
        if saved is not None:
            os.environ["UCX_TLS"] = saved


async def hello_of(address: str) -> dict:
    tcp = TcpTransport()
    try:
        return await tcp.hello(address)
    finally:
        await tcp.close()


async def rate(work, nbytes: int, rounds: int) -> float:
    """MB/s of the best half of `rounds` runs of work() moving `nbytes` each (the box is shared and noisy)."""
    await work()  # warm: connections, page faults
    times = []
    for _ in range(rounds):
        began = time.perf_counter()
        await work()
        times.append(time.perf_counter() - began)
    times.sort()
    best = times[:max(1, len(times) // 2)]
    return round(nbytes / (sum(best) / len(best)) / 1e6)


async def measure(transport, address: str, rounds: int, tag: str) -> dict:
    big = os.urandom(4 * MiB)
    small = [os.urandom(MiB) for _ in range(64)]
    big_sum, small_sums = checksum(big), [checksum(v) for v in small]  # computed once, outside the timings
    keys = [f"{tag}/b{i}".encode() for i in range(64)]
    generation = [0]

    async def write_big():
        generation[0] += 1
        await transport.write(address, f"{tag}/w".encode(), generation[0], memoryview(big), big_sum)

    async def write_batch():
        generation[0] += 1
        items = [WriteItem(k + b"w", generation[0], memoryview(v), c) for k, v, c in zip(keys, small, small_sums)]
        results = await transport.write_many(address, items)
        assert results == [None] * len(items), results

    await transport.write(address, f"{tag}/big".encode(), 1, memoryview(big), checksum(big))
    assert await transport.write_many(address, [WriteItem(k, 1, memoryview(v), checksum(v))
                                                for k, v in zip(keys, small)]) == [None] * 64
    into = memoryview(bytearray(4 * MiB))
    intos = [memoryview(bytearray(MiB)) for _ in range(64)]

    async def read_big():
        assert await transport.read_into(address, f"{tag}/big".encode(), 1, into) == big_sum

    async def read_batch():
        results = await transport.read_many(address, [ReadItem(k, 1, b) for k, b in zip(keys, intos)])
        assert results == small_sums, results

    figures = {
        "read_into_4MiB": await rate(read_big, 4 * MiB, rounds),
        "read_many_64x1MiB": await rate(read_batch, 64 * MiB, max(4, rounds // 4)),
        "write_4MiB": await rate(write_big, 4 * MiB, rounds),
        "write_many_64x1MiB": await rate(write_batch, 64 * MiB, max(4, rounds // 4)),
    }
    assert bytes(into) == big and [bytes(b) for b in intos] == small
    return figures


async def run_setting(address: str, hello: dict, tls: str, rounds: int, credential) -> dict:
    ucx = UcxTransport(options={"TLS": tls} if tls else None, credential=credential)
    tcp = TcpTransport(credential=credential)
    try:
        await ucx.attach(address, hello)
        return {"ucx": await measure(ucx, address, rounds, "ucx"), "tcp": await measure(tcp, address, rounds, "tcp")}
    finally:
        await ucx.close()
        await tcp.close()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tls", action="append", help="UCX_TLS setting (repeatable; '' = default without cma)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args(argv)
    report = {"unit": "MB/s"}
    for tls in args.tls if args.tls is not None else DEFAULT_TLS:
        with tempfile.TemporaryDirectory(prefix="kvpool-ucx-bench-") as data_dir:
            cluster = start_node(tls, data_dir)
            try:
                address = cluster.nodes[0].info["address"]
                hello = asyncio.run(hello_of(address))
                member = auth.Credential.for_member(cluster.secret) if cluster.secret else None
                report[tls or "default"] = asyncio.run(run_setting(address, hello, tls, args.rounds, member))
            finally:
                cluster.stop()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
