"""A call's deadline is the caller's: a silent node or a silent etcd never holds a call past it."""

import asyncio
import signal
import time

import pytest

from kvpool import AsyncClient, Client
from kvpool.errors import ClusterUnavailableError, DeadlineExceededError, KvpoolError
from kvpool.net.netutil import wait_until

MARGIN = 1.5  # seconds a call may end after its deadline on a loaded 2-core machine
PATIENT = 30.0  # node and master timeouts far beyond the calls' deadlines: only the deadline can end them


def test_a_silent_node_holds_no_call_past_its_deadline(own_cluster):
    cluster = own_cluster(nodes=1, lease_ttl=30)  # the stopped node stays a member throughout
    node = cluster.nodes[0]
    options = dict(transports="tcp", read_timeout=PATIENT, write_timeout=PATIENT, rpc_timeout=PATIENT)
    with Client(cluster.master_address, timeout=PATIENT, **options) as client, \
            Client(cluster.master_address, timeout=1.0, **options) as quick:
        client.put("deadline/k", b"v" * 1000)
        assert quick.get("deadline/k") == b"v" * 1000
        node.proc.send_signal(signal.SIGSTOP)  # connected, but nothing is answered any more
        try:
            for call in (lambda: client.get("deadline/k", timeout=1.0),  # the call's own deadline
                         lambda: quick.batch_get(["deadline/k"]),  # the client's
                         lambda: client.put("deadline/new", b"n" * 1000, timeout=1.0)):
                started = time.monotonic()
                with pytest.raises(DeadlineExceededError, match="deadline"):
                    call()
                assert time.monotonic() - started < 1.0 + MARGIN

            async def async_get():
                async with AsyncClient(cluster.master_address, **options) as aclient:
                    assert await aclient.exists("deadline/k", timeout=2.0)
                    started = time.monotonic()
                    with pytest.raises(DeadlineExceededError):
                        await aclient.get("deadline/k", timeout=1.0)
                    return time.monotonic() - started

            assert asyncio.run(async_get()) < 1.0 + MARGIN
        finally:
            node.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: _works(lambda: client.get("deadline/k", timeout=2.0)), timeout=20, interval=0.2,
                   what="the node to serve again")


def test_a_silent_master_holds_no_lookup_past_its_deadline(own_cluster):
    """A blocking batch_exists goes as a LOOKUP on the control socket: the call's deadline bounds it too."""
    cluster = own_cluster(nodes=1)
    options = dict(transports="tcp", rpc_timeout=PATIENT)
    with Client(cluster.master_address, timeout=PATIENT, **options) as client, \
            Client(cluster.master_address, timeout=1.0, **options) as quick:
        client.put("lookup-deadline/k", b"v" * 1000)
        assert client.batch_exists(["lookup-deadline/k", "lookup-deadline/none"]) == [True, False]
        assert quick.batch_exists(["lookup-deadline/k"]) == [True]
        master = cluster.masters[0]
        master.proc.send_signal(signal.SIGSTOP)  # the control connection stays open; nothing is answered
        try:
            for call in (lambda: client.batch_exists(["lookup-deadline/k"], timeout=1.0),  # the call's own
                         lambda: quick.batch_exists(["lookup-deadline/k"])):  # the client's
                started = time.monotonic()
                with pytest.raises(DeadlineExceededError, match="deadline"):
                    call()
                assert time.monotonic() - started < 1.0 + MARGIN
        finally:
            master.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: _works(lambda: client.batch_exists(["lookup-deadline/k"], timeout=2.0)), timeout=20,
                   interval=0.2, what="the master to answer again")


def _works(call) -> bool:
    try:
        call()
        return True
    except KvpoolError:
        return False


def test_puts_fail_at_once_with_a_typed_error_while_etcd_is_silent(own_cluster):
    cluster = own_cluster(nodes=1, master_args=["--election-ttl", "2"], lease_ttl=5)
    with Client(cluster.master_address, timeout=8.0) as client:
        client.put("etcd-silent/before", b"stored")
        cluster.etcd.proc.send_signal(signal.SIGSTOP)  # etcd silent: no refused connection, no answer
        try:
            def refused_at_once():
                started = time.monotonic()
                try:
                    client.put("etcd-silent/during", b"x", overwrite=True)
                except ClusterUnavailableError:
                    return time.monotonic() - started
                return None

            # Within the lease the leader serves on; past what it allows, every put is refused at once.
            wait_until(lambda: refused_at_once() is not None, timeout=15, interval=0.2,
                       what="puts to be refused as the cluster unavailable")
            for _ in range(3):
                took = refused_at_once()
                assert took is not None and took < 1.0
            assert client.get("etcd-silent/before") == b"stored"  # reads do not need the master's lead
        finally:
            cluster.etcd.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: _works(lambda: client.put("etcd-silent/after", b"back", overwrite=True)), timeout=30,
                   interval=0.2, what="puts to work again once etcd answers")
        assert client.get("etcd-silent/after") == b"back"
