"""The blocking Client's puts and gets over TCP run in the caller's thread with no event loop: the master's
answers and the nodes' replies are read on their sockets. Only what needs a loop (a first connection, a
batch spread over several nodes, which go side by side) runs one. Every wait on a socket has a deadline: a
node that stops answering fails the call in time."""

import signal
import time

import pytest

from kvpool import Client
from kvpool.errors import BatchError, KvpoolError, UnavailableError

from test_blocking_lookups import LoopWatch


def test_puts_and_gets_run_no_event_loop(cluster):
    with Client(cluster.master_address, transports="tcp") as client:  # two nodes: batches go to both
        warm = [f"transfers/warm{i}" for i in range(8)]
        client.batch_put(warm, [b"w" * 100] * 8)  # connects to the master and to every node on the loop
        assert client.batch_get(warm) == [b"w" * 100] * 8
        keys = [f"transfers/{i}" for i in range(16)]
        values = [bytes([i]) * (32 << 10) for i in range(16)]
        with LoopWatch() as watch:
            client.put("transfers/one", b"x" * 5000)
            assert client.get("transfers/one") == b"x" * 5000
            client.batch_put(keys[:8], values[:8])
            client.batch_put_from(keys[8:], [memoryview(v) for v in values[8:]])
            dests = [bytearray(32 << 10) for _ in keys]
            assert client.batch_get_into(keys, dests) == [32 << 10] * 16
            assert [bytes(d) for d in dests] == values
            assert client.batch_get(keys + ["transfers/missing"]) == values + [None]
        assert watch.entered == 0
        client.remove_prefix("transfers/")


def test_a_silent_node_fails_a_blocking_get_and_put_in_time(own_cluster):
    cluster = own_cluster(nodes=1)
    node = cluster.nodes[0]
    with Client(cluster.master_address, transports="tcp", read_timeout=1.0, write_timeout=1.0) as client:
        client.put("silent/k", b"v" * 1000)
        assert client.get("silent/k") == b"v" * 1000
        node.proc.send_signal(signal.SIGSTOP)  # connected, but nothing is answered any more
        try:
            started = time.monotonic()
            with pytest.raises(UnavailableError):
                client.get("silent/k")
            assert time.monotonic() - started < 8  # read_timeout, asked once more after a fresh lookup
            started = time.monotonic()
            with pytest.raises((UnavailableError, BatchError)):
                client.batch_put(["silent/a", "silent/b"], [b"a" * 1000, b"b" * 1000])
            assert time.monotonic() - started < 8
        finally:
            node.proc.send_signal(signal.SIGCONT)
        # The node answers again (its lease may have lapsed meanwhile, its objects with it): a new connection.
        # It takes writes at once, and serves reads once the leader has reconciled it (its read grant lapsed
        # while it was stopped): until then a read of its only copy is refused.
        deadline = time.monotonic() + 20
        while True:
            try:
                client.put("silent/after", b"z" * 1000, overwrite=True)
                assert client.get("silent/after") == b"z" * 1000
                break
            except KvpoolError:
                assert time.monotonic() < deadline, "the node did not come back"
                time.sleep(0.1)
