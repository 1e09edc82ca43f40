"""Key listing (list_keys, iter_keys, `kvpool keys`, ListKeys) against a real cluster: every key once, in byte
order, a page at a time; prefixes; a cursor that stays true while other keys come and go; limits refused typed
on both ports; puts in progress and expired objects not listed; the keys a new leader adopted listed after a
failover."""

import asyncio
import json
import subprocess
import sys
import threading

import grpc
import pytest

from kvpool import AsyncClient, Client
from kvpool.errors import InvalidArgumentError, InvalidKeyError
from kvpool.net.netutil import free_port, wait_until
from kvpool.proto import kvpool_pb2 as pb
from kvpool.proto import kvpool_pb2_grpc
from kvpool.security import auth
from kvpool.security.grpc_auth import blocking_channel
from storenode_harness import master_channel

FAST_ELECTION = ["--election-ttl", "2"]
KVPOOL = [sys.executable, "-m", "kvpool.commands.cli"]


def every_page(client: Client, prefix: str, limit: int) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        keys, cursor = client.list_keys(prefix, limit, cursor)
        pages.append(keys)
        if cursor is None:
            return pages


def test_pages_list_every_key_once_in_byte_order(client):
    keys = [f"pages/{i:04d}" for i in range(250)] + ["pages/é", "pages/z", "pages/\U0001f600", "pages/\x7f"]
    client.batch_put(keys, [b"v"] * len(keys))
    pages = every_page(client, "pages/", 100)
    assert [len(page) for page in pages] == [100, 100, 54]
    listed = [key for page in pages for key in page]
    assert listed == sorted(keys, key=str.encode)  # byte order: UTF-8's order is the code points'
    assert every_page(client, "pages/", 10_000) == [listed]
    assert list(client.iter_keys("pages/")) == listed
    exact = every_page(client, "pages/", 254)  # a full page with nothing after it ends the listing
    assert exact == [listed]


def test_a_prefix_lists_only_its_keys(client):
    client.batch_put(["pre/a/1", "pre/a/2", "pre/ab", "pre/b/1", "pre"], [b"v"] * 5)
    assert client.list_keys("pre/a/") == (["pre/a/1", "pre/a/2"], None)
    assert client.list_keys("pre/a") == (["pre/a/1", "pre/a/2", "pre/ab"], None)
    assert client.list_keys("pre/c") == ([], None)
    every = [key for page in every_page(client, "", 1000) for key in page]
    assert {"pre/a/1", "pre/b/1", "pre"} <= set(every) and every == sorted(every)


def test_the_cursor_lists_what_stayed_once_while_others_come_and_go(cluster):
    stays = [f"churn/{i:04d}" for i in range(0, 1000, 2)]
    others = [f"churn/{i:04d}" for i in range(1, 1000, 2)]
    stop = threading.Event()
    churned = []

    with Client(cluster.master_address) as client:
        client.batch_put(stays, [b"s"] * len(stays))
        client.batch_put(others[::2], [b"o"] * len(others[::2]))

        def churn():
            with Client(cluster.master_address) as other:
                i = 0
                while not stop.is_set():
                    key = others[i % len(others)]
                    if i // len(others) % 2:
                        other.remove(key)
                    else:
                        other.put(key, b"o", overwrite=True)
                    churned.append(key)
                    i += 1

        worker = threading.Thread(target=churn, daemon=True)
        worker.start()
        try:
            seen, cursor = [], None
            while True:
                wait_until(lambda mark=len(churned): len(churned) > mark + 5, 10, what="other keys to change")
                keys, cursor = client.list_keys("churn/", 37, cursor)
                seen += keys
                if cursor is None:
                    break
        finally:
            stop.set()
            worker.join(10)
    assert [key for key in seen if key in set(stays)] == stays
    assert len(seen) == len(set(seen)) and seen == sorted(seen)
    assert len(churned) > 50


def test_bad_limits_prefixes_and_cursors_are_refused_typed(client):
    for limit in (0, -1, 10_001, 2.5, "10"):
        with pytest.raises(InvalidArgumentError, match="limit"):
            client.list_keys("", limit)
    with pytest.raises(InvalidKeyError, match="prefix"):
        client.list_keys("a\x00b")
    with pytest.raises(InvalidKeyError, match="cursor"):
        client.list_keys("", 10, "x" * 2000)
    assert client.list_keys("", 10_000)[0] is not None  # the bounds themselves are fine
    assert len(client.list_keys("", 1)[0]) <= 1


def test_the_master_refuses_bad_limits_on_both_ports(cluster):
    with master_channel(cluster.master_address) as channel:  # gRPC
        stub = kvpool_pb2_grpc.MasterStub(channel)
        for limit in (-5, 10_001):
            answer = stub.ListKeys(pb.ListKeysRequest(limit=limit), timeout=5)
            assert answer.status == pb.INVALID_ARGUMENT and "limit" in answer.message
        answer = stub.ListKeys(pb.ListKeysRequest(cursor="x" * 2000), timeout=5)
        assert answer.status == pb.INVALID_KEY and "cursor" in answer.message
        assert stub.ListKeys(pb.ListKeysRequest(prefix="no-such-prefix/"), timeout=5).status == pb.OK

    async def control_port():  # the client's own path: the leader's control port
        async with AsyncClient(cluster.master_address) as client:
            master = client._core.master
            answer = await master.call("ListKeys", pb.ListKeysRequest(limit=10_001))
            assert answer.status == pb.INVALID_ARGUMENT and "limit" in answer.message
            assert await client.list_keys("no-such-prefix/") == ([], None)  # and it still serves

    asyncio.run(control_port())


def test_puts_in_progress_and_expired_objects_are_not_listed(client, cluster):
    with master_channel(cluster.master_address) as channel:
        stub = kvpool_pb2_grpc.MasterStub(channel)
        started = stub.PutStart(pb.PutStartRequest(key="pending/started", size=10, checksum=1), timeout=5)
        assert started.status == pb.OK
    client.put("pending/done", b"v")
    client.put("pending/short-lived", b"v", ttl=0.5)
    assert client.list_keys("pending/")[0] in (["pending/done", "pending/short-lived"], ["pending/done"])
    wait_until(lambda: client.list_keys("pending/") == (["pending/done"], None), 10,
               what="the expired object to leave the listing")


def test_async_client_lists_and_iterates(cluster):
    async def run():
        async with AsyncClient(cluster.master_address) as client:
            keys = [f"aio/{i:03d}" for i in range(30)]
            await client.batch_put(keys, [b"v"] * len(keys))
            first, cursor = await client.list_keys("aio/", 20)
            rest, end = await client.list_keys("aio/", 20, cursor)
            assert first + rest == keys and cursor == keys[19] and end is None
            assert [key async for key in client.iter_keys("aio/")] == keys

    asyncio.run(run())


def _kvpool(*args, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*KVPOOL, *args], capture_output=True, text=True, timeout=timeout)


def test_kvpool_keys_prints_every_page_or_json(client, cluster):
    keys = [f"cli/{i:05d}" for i in range(10_050)]  # more than one page of the largest
    for start in range(0, len(keys), 2000):
        client.batch_put(keys[start:start + 2000], [b"v"] * len(keys[start:start + 2000]))
    listed = _kvpool("keys", "cli/", "--master", cluster.master_address)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == keys
    found = _kvpool("keys", "cli/0000", "--etcd", cluster.etcd_endpoint, "--json")
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout) == keys[:10]
    first = _kvpool("keys", "cli/", "--master", cluster.master_address, "--limit", "3")
    assert first.stdout.splitlines() == keys[:3]


def test_kvpool_keys_failures_end_in_one_line_saying_what_to_do():
    dead = f"127.0.0.1:{free_port()}"
    failed = _kvpool("keys", "x/", "--master", dead)
    assert failed.returncode == 1
    last = failed.stderr.strip().splitlines()[-1]
    assert last.startswith("kvpool keys:") and dead in last and "--master" in last
    refused = _kvpool("keys", "x/", "--master", dead, "--limit", "0")
    assert refused.returncode == 1 and "--limit must be at least 1" in refused.stderr.strip().splitlines()[-1]


def test_a_new_leader_lists_the_keys_it_adopted(own_cluster):
    cluster = own_cluster(nodes=2, masters=2, master_args=FAST_ELECTION)
    old, new = cluster.masters
    keys = [f"adopted/{i:05d}" for i in range(3000)]
    with Client(cluster.master_addresses) as client:
        client.batch_put(keys, [b"v"] * len(keys))
        client.remove(keys[7])
        assert [key for page in every_page(client, "adopted/", 1000) for key in page] == keys[:7] + keys[8:]
    old.kill()
    address = new.info["address"]
    with Client(address, rpc_timeout=30, timeout=30) as client:
        def listed():  # refused (UnavailableError) while the new leader still adopts the nodes' inventories
            try:
                return [key for page in every_page(client, "adopted/", 1000) for key in page]
            except Exception:  # noqa: BLE001 - not leading or not adopted yet: asked again
                return None

        wait_until(lambda: listed() is not None, 30, what="the new leader to list keys")
        assert listed() == keys[:7] + keys[8:]


def test_each_caller_lists_only_its_own_key_space(cluster):
    tokens = {name: cluster.add_tenant(name) for name in ("list-a", "list-b")}
    names = [f"scoped/{i:02d}" for i in range(12)]
    with Client(cluster.master_address, token=tokens["list-a"]) as a, \
            Client(cluster.master_address, token=tokens["list-b"]) as b, \
            Client(cluster.master_address, token=cluster.client_token) as plain, \
            Client(cluster.master_address) as member:
        a.batch_put(names, [b"a"] * len(names))
        b.batch_put(names[:3], [b"b"] * 3)
        plain.put("scoped/plain", b"p")
        # A tenant's keys and cursors as it names them, a page at a time.
        first, cursor = a.list_keys("scoped/", 5)
        assert first == names[:5] and cursor == names[4]
        assert [key for page in every_page(a, "scoped/", 5) for key in page] == names
        assert list(a.iter_keys()) == names  # "" is every key of its own, none of anyone else's
        assert list(b.iter_keys("scoped/")) == names[:3]
        assert list(plain.iter_keys("scoped/")) == ["scoped/plain"]  # the client token: the keys of no tenant
        assert all(not key.startswith("\x01") for key in plain.iter_keys())
        everything = list(member.iter_keys())  # the operator: every key as stored
        assert {"\x01list-a\x01scoped/00", "\x01list-b\x01scoped/02", "scoped/plain"} <= set(everything)
    # A tenant asking by hand for another tenant's stored prefix, a cursor there, or a prefix outside its scope is
    # refused, as every call naming a key outside it is (kvpool/security/roles.py check_scope).
    with blocking_channel(cluster.master_address, auth.caller_credential(tokens["list-a"])) as channel:
        stub = kvpool_pb2_grpc.MasterStub(channel)
        for request in (pb.ListKeysRequest(prefix="\x01list-b\x01"), pb.ListKeysRequest(prefix="scoped/"),
                        pb.ListKeysRequest(prefix="\x01list-a\x01", cursor="\x01list-b\x01")):
            with pytest.raises(grpc.RpcError) as refused:
                stub.ListKeys(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        own = stub.ListKeys(pb.ListKeysRequest(prefix="\x01list-a\x01scoped/1"), timeout=5)
        assert list(own.keys) == ["\x01list-a\x01" + name for name in names[10:]]
