"""The UCX transport (kvpool[ucx]) against real storage nodes, over UCX_TLS=tcp and over shared memory.

The node takes UCX_TLS from the environment it is started with; the client
gets the same setting through UcxTransport's options, as UCX reads it per
context.
"""

import asyncio
import os
import random
import signal
import subprocess
import sys
import time

import pytest

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")  # before ucxx sets a variable this UCX no longer knows
pytest.importorskip("ucxx")

from kvpool.protocol.checksum import checksum  # noqa: E402
from kvpool.client.tcp import TcpTransport  # noqa: E402
from kvpool.net.tcp_link import TcpLink  # noqa: E402
from kvpool.client.transport import ReadItem, WriteItem, WriteOptions  # noqa: E402
from kvpool.client.ucx import UcxTransport  # noqa: E402
from kvpool.errors import (ChecksumMismatchError, InvalidArgumentError, KeyNotFoundError,  # noqa: E402
                           NotLeaderError, StaleReplicaError, UnavailableError, ValueTooLargeError)
from kvpool.launch.local_cluster import LocalCluster  # noqa: E402
from kvpool.net.netutil import wait_until  # noqa: E402
from kvpool.net.ucx_common import SAFE_TLS, settings  # noqa: E402
from kvpool.protocol.wire import WriteFlag  # noqa: E402
from storenode_harness import member_credential, tier_names  # noqa: E402

MiB = 1 << 20
TLS_SETTINGS = ["tcp", "posix,cma,self"]
# With cma, a peer dying mid-copy aborts the process that copies (see kvpool/net/ucx_common.py), so peers
# are killed only over what survives it: tcp, and kvpool's default, all but cma (sysv shared memory here).
KILLABLE_TLS_SETTINGS = ["tcp", "^cma"]
ON_SSD = WriteOptions(flags=WriteFlag.PREFER_SSD)


def start_ucx_cluster(data_dir, tls: str, **options) -> LocalCluster:
    """etcd, a master and one storage node serving UCX over `tls`."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("UCX_TLS", tls)
        return LocalCluster(nodes=1, data_dir=data_dir, lease_ttl=2, node_args=["--transports", "tcp,ucx"],
                            **options).start()


def ucx_hello(node) -> dict:
    """The node's HELLO reply, whose "ucx" entry is what UcxTransport.attach needs."""
    async def ask():
        tcp = TcpTransport()
        try:
            return await tcp.hello(node.info["address"])
        finally:
            await tcp.close()

    return asyncio.run(ask())


@pytest.fixture(scope="module", params=TLS_SETTINGS)
def node(request, tmp_path_factory):
    """(tls, node address, HELLO) of a node with DRAM and SSD tiers, shared by the module's tests."""
    tls = request.param
    cluster = start_ucx_cluster(tmp_path_factory.mktemp("ucx"), tls, dram_per_node="160MiB",
                                ssd_per_node="96MiB")
    try:
        yield tls, cluster.nodes[0].info["address"], ucx_hello(cluster.nodes[0])
    finally:
        cluster.stop()


def with_ucx(node, work, **options):
    """Run work(transport, address) on a UcxTransport attached to the node, on a fresh event loop; it proves
    the member role unless told otherwise (its writes are not placed by a leader, so carry no seal)."""
    tls, address, hello = node
    options.setdefault("credential", member_credential())

    async def main():
        transport = UcxTransport(options={"TLS": tls}, **options)
        try:
            await transport.attach(address, hello)
            return await work(transport, address)
        finally:
            await transport.close()

    return asyncio.run(main())


async def holdings(address: str) -> dict:
    """key -> tiers holding it, from the node's INVENTORY (over TCP)."""
    tcp = TcpLink(credential=member_credential())
    try:
        return {entry.key: tier_names(entry) for entry in await tcp.inventory(address)}
    finally:
        await tcp.close()


async def free_all(address: str, keys) -> None:
    tcp = TcpLink(credential=member_credential())
    try:
        for key, generation in keys:
            await tcp.free(address, key, generation)
    finally:
        await tcp.close()


def test_round_trips_are_byte_exact_in_dram_and_on_ssd(node):
    rng = random.Random(5)
    sizes = [1, 63, 8191, 8193, 65537, rng.randrange(1, MiB), rng.randrange(MiB, 16 * MiB), 64 * MiB]
    ssd_sizes = [1, 65537, rng.randrange(MiB, 8 * MiB)]

    async def work(ucx, address):
        stored = []
        for where, chosen, options in (("dram", sizes, None), ("ssd", ssd_sizes, ON_SSD)):
            for i, size in enumerate(chosen):
                key, value = f"rt/{where}/{i}".encode(), os.urandom(size)
                await ucx.write(address, key, 7, memoryview(value), checksum(value), options)
                stored.append((key, 7))
                buf = bytearray(size)
                assert await ucx.read_into(address, key, 7, memoryview(buf)) == checksum(value)
                assert buf == value, f"{where} {size} bytes differ"
        tiers = await holdings(address)
        assert all(tiers[f"rt/dram/{i}"] == ["dram"] for i in range(len(sizes)))
        assert all(tiers[f"rt/ssd/{i}"] == ["ssd"] for i in range(len(ssd_sizes)))
        await free_all(address, stored)

    with_ucx(node, work)


def test_batches_are_pipelined_with_per_item_results(node):
    rng = random.Random(6)
    values = [os.urandom(rng.randrange(1, 300_000)) for _ in range(40)]
    keys = [f"batch/{i}".encode() for i in range(len(values))]

    async def work(ucx, address):
        writes = [WriteItem(k, 3, memoryview(v), checksum(v), ON_SSD if i % 5 == 0 else None)
                  for i, (k, v) in enumerate(zip(keys, values))]
        assert await ucx.write_many(address, writes) == [None] * len(values)
        buffers = [bytearray(len(v)) for v in values] + [bytearray(10)]
        reads = [ReadItem(k, 3, memoryview(b)) for k, b in zip(keys + [b"batch/missing"], buffers)]
        results = await ucx.read_many(address, reads)
        assert results[:-1] == [checksum(v) for v in values]
        assert isinstance(results[-1], KeyNotFoundError)
        assert [bytes(b) for b in buffers[:-1]] == values
        # A refused item in a batch leaves the ones after it alone.
        bad = values[0]
        mixed = [WriteItem(b"batch/bad", 3, memoryview(bad), checksum(bad) ^ 1), writes[1]._replace(generation=4)]
        results = await ucx.write_many(address, mixed)
        assert isinstance(results[0], ChecksumMismatchError) and results[1] is None
        await free_all(address, [(k, 3) for k in keys] + [(keys[1], 4)])

    with_ucx(node, work)


def test_errors_are_typed_and_leave_the_connection_usable(node):
    value = os.urandom(100_000)

    async def work(ucx, address):
        await ucx.write(address, b"err/k", 10, memoryview(value), checksum(value))
        buf = memoryview(bytearray(len(value)))
        with pytest.raises(KeyNotFoundError):
            await ucx.read_into(address, b"err/unknown", 10, buf)
        with pytest.raises(StaleReplicaError):
            await ucx.read_into(address, b"err/k", 11, buf)  # a generation this node does not hold
        with pytest.raises(StaleReplicaError):
            await ucx.read_into(address, b"err/k", 10, buf[:-1])  # wrong length
        with pytest.raises(ChecksumMismatchError):
            await ucx.write(address, b"err/bad", 1, memoryview(value), checksum(value) ^ 1)
        assert "err/bad" not in await holdings(address)
        with pytest.raises(InvalidArgumentError):
            await ucx.write(address, b"err/empty", 1, memoryview(b""), checksum(b""))
        huge = bytearray(200 * MiB)  # more than either tier: refused, and its payload swallowed unread
        with pytest.raises(ValueTooLargeError):
            await ucx.write(address, b"err/huge", 1, memoryview(huge), 0)
        tcp = TcpLink(credential=member_credential())
        try:
            await tcp.report(address, term=50)  # a master of term 50 leads now
        finally:
            await tcp.close()
        with pytest.raises(NotLeaderError):
            await ucx.write(address, b"err/old-term", 1, memoryview(value), checksum(value), term=49)
        await ucx.write(address, b"err/new-term", 1, memoryview(value), checksum(value), term=50)
        # Still the same connection, and it still works.
        assert await ucx.read_into(address, b"err/k", 10, buf) == checksum(value)
        assert set(await holdings(address)) >= {"err/k", "err/new-term"}
        await free_all(address, [(b"err/k", 10), (b"err/new-term", 1)])

    with_ucx(node, work)


def test_attach_refuses_a_node_without_ucx(node):
    tls, address, hello = node

    async def main():
        transport = UcxTransport(options={"TLS": tls})
        try:
            with pytest.raises(UnavailableError):
                await transport.attach(address, {"transports": {}})
            with pytest.raises(UnavailableError):
                await transport.attach(address, {"transports": {"ucx": {"address": "zz"}}})
            with pytest.raises(UnavailableError):  # never attached
                await transport.read_into(address, b"k", 1, memoryview(bytearray(1)))
        finally:
            await transport.close()

    asyncio.run(main())


_DYING_WRITER = """
import asyncio, json, sys
from kvpool.protocol.checksum import checksum
from kvpool.client.ucx import UcxTransport
async def main():
    transport = UcxTransport(options={"TLS": sys.argv[1]})
    await transport.attach(sys.argv[2], json.loads(sys.argv[3]))
    value = memoryview(bytearray(64 << 20))
    print("writing", flush=True)
    for generation in range(1, 1000):
        await transport.write(sys.argv[2], b"dying/k", generation, value, checksum(value))
asyncio.run(main())
"""


@pytest.mark.parametrize("tls", KILLABLE_TLS_SETTINGS)
def test_dead_peers_cost_a_timeout_not_a_hang(tls, tmp_path):
    import json

    cluster = start_ucx_cluster(tmp_path, tls, dram_per_node="160MiB")
    try:
        child = cluster.nodes[0]
        address, hello = child.info["address"], ucx_hello(child)
        # A client killed in the middle of its writes: the node keeps serving others.
        writer = subprocess.Popen([sys.executable, "-c", _DYING_WRITER, tls, address, json.dumps(hello)],
                                  stdout=subprocess.PIPE, env={**os.environ, "UCX_TLS": tls})
        try:
            assert writer.stdout.readline() == b"writing\n"
        finally:
            writer.send_signal(signal.SIGKILL)
            writer.wait()
            writer.stdout.close()
        value = os.urandom(64 * MiB)
        big = memoryview(bytearray(len(value)))

        async def work(ucx, address):
            await ucx.write(address, b"dead/k", 1, memoryview(value), checksum(value))
            assert await ucx.read_into(address, b"dead/k", 1, big) == checksum(value)
            # A node that stops answering costs the timeout (1 s here), no more.
            child.signal(signal.SIGSTOP)
            try:
                began = time.monotonic()
                with pytest.raises(UnavailableError):
                    await ucx.read_into(address, b"dead/k", 1, big)
                assert 1 <= time.monotonic() - began < 3
            finally:
                child.signal(signal.SIGCONT)
            assert await ucx.read_into(address, b"dead/k", 1, big) == checksum(value)  # on a new connection
            # A node that dies with a batch of reads in flight fails them sooner than that: UCX sees
            # the TCP connection reset, and on shared memory the client sees the node's process gone.
            reads = asyncio.ensure_future(ucx.read_many(address, [ReadItem(b"dead/k", 1, big)] * 16))
            await asyncio.sleep(0)  # let the requests go out
            began = time.monotonic()
            child.kill()
            results = await reads
            assert time.monotonic() - began < 0.9
            assert isinstance(results[-1], UnavailableError), results[-1]
            assert all(isinstance(r, UnavailableError) or r == checksum(value) for r in results)
            began = time.monotonic()
            with pytest.raises(UnavailableError):
                await ucx.read_into(address, b"dead/k", 1, big)
            assert time.monotonic() - began < 0.9

        assert child.alive
        # The reads' timeout is what is measured; the handshake gets room for a loaded machine (a node
        # still tearing down the killed writer's endpoint answered it in over 1 s once).
        with_ucx((tls, address, hello), work, timeout=1.0, connect_timeout=5.0, min_rate=1e12)
        wait_until(lambda: not child.alive, 5, what="the node to be gone")
    finally:
        cluster.stop()


def test_cma_is_left_out_unless_asked_for(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    assert settings() == {"TLS": SAFE_TLS}
    assert settings({"TLS": "posix,cma,self", "RNDV_THRESH": 16384}) == {"TLS": "posix,cma,self",
                                                                      "RNDV_THRESH": "16384"}
    monkeypatch.setenv("UCX_TLS", "tcp")
    assert settings() == {}
