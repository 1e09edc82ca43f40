"""Every data transport moves values byte-exact; the client picks the best one per node and falls back."""

import json
import logging
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest

from kvpool import Client
from kvpool.client.shm import SMALL_WRITE
from kvpool.errors import ForbiddenError

MIB = 1024 * 1024
# 0 B to 64 MiB, with sizes that are not multiples of anything.
SIZES = [0, 1, 7, 4095, 65536 + 3, MIB - 1, 4 * MIB, 16 * MIB + 5, 64 * MIB]


def _value(size: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def _round_trips(master_address: str, transport: str) -> None:
    """Values of random sizes, 0 B to 64 MiB, one by one and in batches, both ways, only over `transport`."""
    sizes = SIZES + [random.Random(transport).randrange(1, 8 * MIB) for _ in range(3)]
    values = {f"{transport}/one/{i}": _value(size, i) for i, size in enumerate(sizes)}
    with Client(master_address, transports=transport) as client:
        try:
            for key, value in values.items():
                client.put(key, value)
                assert client.get(key) == value
                buf = bytearray(len(value) + 3)
                assert client.get_into(key, buf) == len(value) and buf[:len(value)] == value
            # Batches, both directions; the big values stay out to keep the nodes' DRAM free.
            batch = {f"{transport}/batch/{i}": _value(random.Random(i).randrange(0, 2 * MIB), 100 + i)
                     for i in range(24)}
            client.batch_put(list(batch), list(batch.values()))
            assert client.batch_get(list(batch)) == list(batch.values())
            buffers = [bytearray(len(v)) for v in batch.values()]
            assert client.batch_get_into(list(batch), buffers) == [len(v) for v in batch.values()]
            assert [bytes(b) for b in buffers] == list(batch.values())
            moved = client.bytes_by_transport()
        finally:
            client.remove_prefix(f"{transport}/")
    # Forced: nothing went another way. Every value went out once and came back twice; over shm,
    # values below SMALL_WRITE go out in one WRITE on the shm path's socket, counted as tcp.
    every = [*values.values(), *batch.values()]
    small = sum(len(v) for v in every if len(v) < SMALL_WRITE) if transport == "shm" else 0
    expected = {transport: 3 * sum(len(v) for v in every) - small}
    if small:
        expected["tcp"] = small
    assert moved == expected


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_forced_transport_moves_random_sizes_byte_exact(cluster, transport):
    _round_trips(cluster.master_address, transport)


def test_forced_ucx_moves_random_sizes_byte_exact(own_cluster):
    pytest.importorskip("ucxx")
    running = own_cluster(nodes=2, dram_per_node="192MiB", node_args=["--transports", "shm,ucx,tcp"])
    _round_trips(running.master_address, "ucx")


def test_shared_memory_is_chosen_by_default_on_the_same_host(cluster):
    with Client(cluster.master_address) as client:
        client.put("default/a", b"x" * MIB)
        assert client.get("default/a") == b"x" * MIB
        client.remove("default/a")
        assert set(client.bytes_by_transport()) == {"shm"}
        node = cluster.master_stats().nodes[0]
        assert list(node.transports)[-1] == "tcp" and "shm" in node.transports


def test_ssd_objects_travel_beside_shared_memory(own_cluster):
    running = own_cluster(nodes=1, ssd_per_node="64MiB")
    values = {f"ssd/{i}": _value(MIB + i, i) for i in range(4)}
    with Client(running.master_address, transports="shm") as client:
        client.batch_put(list(values), list(values.values()), tier="ssd")
        client.put("ssd/one", values["ssd/0"], tier="ssd")
        client.put("dram/one", values["ssd/0"])
        assert client.batch_get(list(values)) == list(values.values())
        assert client.get("ssd/one") == values["ssd/0"] and client.get("dram/one") == values["ssd/0"]
        # SSD objects travel on the shm path's TCP connection, and are counted as such.
        ssd_bytes = 2 * (sum(len(v) for v in values.values()) + len(values["ssd/0"]))
        assert client.bytes_by_transport() == {"tcp": ssd_bytes, "shm": 2 * len(values["ssd/0"])}


def test_shared_memory_is_for_clients_with_the_cluster_credential_only(own_cluster):
    running = own_cluster(nodes=1)
    value = os.urandom(MIB)
    with Client(running.master_address, transports="shm") as client:
        client.put("t/0", value)
        assert client.get("t/0") == value
        assert set(client.bytes_by_transport()) == {"shm"}
    wrong = "kvpool-client-v1:" + "ab" * 32
    for transports in ("shm,tcp", "shm"):  # no transport lets a wrong token in: nothing to fall back to
        with Client(running.master_address, token=wrong, transports=transports) as client:
            with pytest.raises(ForbiddenError):
                client.get("t/0")


_CLIENT_SCRIPT = """
import json, sys
from kvpool import Client
with Client(sys.argv[1], transports="shm,tcp") as client:
    client.put("ns/a", b"v" * 300000)
    ok = client.get("ns/a") == b"v" * 300000
    print(json.dumps({"ok": ok, "moved": client.bytes_by_transport()}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="needs root and unshare")
def test_a_client_that_cannot_see_the_segment_uses_tcp(cluster):
    # Same host, but its own /dev/shm (as in a container that does not share it).
    shell = f'mount -t tmpfs tmpfs /dev/shm && exec "{sys.executable}" -c "$0" "$1"'
    result = subprocess.run(["unshare", "--mount", "--fork", "sh", "-c", shell, _CLIENT_SCRIPT,
                             cluster.master_address], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"ok": True, "moved": {"tcp": 600000}}
    assert "not using shm" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ss"), reason="needs root and ss to kill sockets")
def test_killing_the_shared_memory_path_mid_transfer_falls_back_without_losing_it(cluster, caplog):
    import signal
    import threading

    from kvpool.net.netutil import wait_until

    victim = cluster.nodes[0]
    node = victim.info["address"]
    values = {f"kill/{i}": _value(MIB + i, 500 + i) for i in range(24)}
    with Client(cluster.master_address, transports="shm,tcp") as client:
        client.batch_put(list(values), list(values.values()))
        mine = [k for k in values if client._core.cache.get(k).replicas[0].address == node]
        assert mine, "some values must live on the node whose connection is killed"
        buffers = [bytearray(len(values[k])) for k in mine]
        assert client.batch_get_into(mine, buffers) and client.bytes_by_transport().keys() == {"shm"}
        connection = client._core.transport.tcp._connections[node]
        outcome = []
        with caplog.at_level(logging.WARNING, logger="kvpool.client.selector"):
            victim.signal(signal.SIGSTOP)  # the node cannot answer: the next batch stays in flight
            try:
                for buf in buffers:
                    buf[:] = bytes(len(buf))
                thread = threading.Thread(target=lambda: outcome.append(client.batch_get_into(mine, buffers)))
                thread.start()
                wait_until(lambda: connection._pending, 10, what="LOCATEs in flight")
                port = node.rpartition(":")[2]
                subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}"], check=True,
                               capture_output=True)
            finally:
                victim.signal(signal.SIGCONT)
            thread.join(60)
        assert outcome == [[len(values[k]) for k in mine]]
        assert all(bytes(b) == values[k] for b, k in zip(buffers, mine))  # nothing lost or corrupted
        moved = client.bytes_by_transport()
        client.remove_prefix("kill/")
    assert moved.get("tcp") == sum(len(values[k]) for k in mine)  # the killed batch went over TCP
    assert any("not using shm" in r.getMessage() for r in caplog.records)
