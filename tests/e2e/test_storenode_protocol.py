"""A real storage node process and a real etcd, driven over raw sockets with the data protocol."""

import asyncio
import os
import signal
import socket
import stat

import pytest
from storenode_harness import (call, closed_by_node, member_credential, free, get, hold, inventory, put, read_frame, read_reply,
                               report, start_node, write_frame, write_status)
from storenode_harness import ping as ping_node

import kvpool
from kvpool.protocol import wire
from kvpool.protocol.checksum import checksum
from kvpool.protocol.cluster_layout import NodeRecord, node_key, parse_hostport
from kvpool.cluster.etcd_client import EtcdClient
from kvpool.errors import Code, UnavailableError
from kvpool.net.netutil import wait_until
from kvpool.protocol.wire import Op, WriteFlag

SEGMENT = 64 * 1024 * 1024


@pytest.fixture
def node(etcd, tmp_path):
    n = start_node(etcd, tmp_path)
    yield n
    n.stop()
    assert "Traceback" not in n.log()  # bad input never reached an unhandled error


def etcd_get(endpoint: str, key: bytes):
    async def fetch():
        host, port = parse_hostport(endpoint)
        async with EtcdClient(host, port, member_credential()) as client:
            return await client.get(key)
    return asyncio.run(fetch())


def test_write_then_read_round_trip_is_byte_exact(node):
    for i, size in enumerate([1, 100, 4096, 65536, 65537, 300_000, 3 * 1024 * 1024 + 5]):
        data = os.urandom(size)
        put(node, b"obj-%d" % i, 100 + i, data)
        with node.connect() as sock:
            sock.sendall(read_frame(b"obj-%d" % i, 100 + i, size, req_id=7))
            op, req_id, status, value_checksum, payload = read_reply(sock)
        assert (op, req_id, status) == (Op.READ, 7, Code.OK)
        assert value_checksum == checksum(data)
        assert payload == data, f"size {size}"


def test_pipelined_requests_get_replies_in_order(node):
    small, big = os.urandom(1000), os.urandom(700_000)  # big is larger than the node's staging buffer
    frames = [
        write_frame(b"a", 1, small, req_id=1),
        write_frame(b"b", 1, big, req_id=2),
        read_frame(b"a", 1, len(small), req_id=3),
        wire.pack_request(Op.PING, 4, b""),
        read_frame(b"b", 1, len(big), req_id=5),
        read_frame(b"a", 2, len(small), req_id=6),
        wire.pack_request(Op.FREE, 7, b"a", 1),
        read_frame(b"a", 1, len(small), req_id=8),
        wire.pack_request(Op.HOLD, 9, b"b", 1, arg=1000),
        wire.pack_request(Op.REPORT, 10, b""),
    ]
    with node.connect() as sock:
        sock.sendall(b"".join(frames) + b"garbage that ends the connection".ljust(wire.REQUEST.size))
        replies = [read_reply(sock) for _ in frames]
        assert closed_by_node(sock)
    assert [r[1] for r in replies] == list(range(1, 11))
    assert [r[2] for r in replies] == [Code.OK, Code.OK, Code.OK, Code.OK, Code.OK, Code.STALE, Code.OK,
                                       Code.NOT_FOUND, Code.OK, Code.OK]
    assert replies[2][4] == small
    assert replies[3][4] == node.node_id.encode()
    assert replies[4][4] == big


def test_stale_and_not_found_reads_and_frees(node):
    data = os.urandom(5000)
    put(node, b"k", 10, data)
    assert get(node, b"k", 11, len(data))[0] == Code.STALE       # the key is here, at another generation
    assert get(node, b"other", 10, len(data))[0] == Code.NOT_FOUND
    assert get(node, b"k", 10, len(data) - 1)[0] == Code.STALE   # the master's size is not this version's
    assert free(node, b"k", 11) == Code.NOT_FOUND
    assert hold(node, b"k", 11, 1000) == Code.NOT_FOUND
    assert get(node, b"k", 10, len(data)) == (Code.OK, data)
    assert free(node, b"k", 10) == Code.OK
    status, message = get(node, b"k", 10, len(data))
    assert status == Code.NOT_FOUND and message  # error replies carry a message
    assert free(node, b"k", 10) == Code.NOT_FOUND


def test_two_generations_of_a_key_coexist_until_freed(node):
    old, new = os.urandom(3000), os.urandom(4000)
    put(node, b"k", 1, old)
    put(node, b"k", 2, new)
    assert get(node, b"k", 1, len(old)) == (Code.OK, old)
    assert get(node, b"k", 2, len(new)) == (Code.OK, new)
    assert free(node, b"k", 1) == Code.OK
    assert get(node, b"k", 1, len(old))[0] == Code.STALE
    assert get(node, b"k", 2, len(new)) == (Code.OK, new)
    # A stored version is final: other bytes under it are refused (even from a member), the same bytes
    # again (a retried write) are taken and change nothing.
    for other in (os.urandom(100), os.urandom(len(new))):
        status, message = write_status(node, b"k", 2, other)
        assert status == Code.EXISTS and "never replaced" in message
    put(node, b"k", 2, new)
    assert get(node, b"k", 2, len(new)) == (Code.OK, new)
    assert list(inventory(node)) == [("k", 2)]


def test_bad_checksum_is_refused_and_not_readable(node):
    data = os.urandom(200_000)
    with node.connect() as sock:
        sock.sendall(write_frame(b"k", 1, data, req_id=3, value_checksum=checksum(data) ^ 1))
        assert read_reply(sock)[1:3] == (3, Code.CHECKSUM_MISMATCH)
        # The whole payload was consumed, so the connection stays in step.
        sock.sendall(read_frame(b"k", 1, len(data), req_id=4))
        assert read_reply(sock)[1:3] == (4, Code.NOT_FOUND)
    assert report(node)["tiers"]["dram"]["used"] == 0  # the extent was given back


def test_writes_it_cannot_take_get_error_replies_then_close(node):
    for length, code in [(0, Code.INVALID_ARGUMENT), (SEGMENT + 1, Code.TOO_LARGE), (2**63, Code.TOO_LARGE)]:
        with node.connect() as sock:
            sock.sendall(wire.pack_request(Op.WRITE, 9, b"k", 1, 0, length, 0)
                         + wire.WRITE_OPTIONS.pack(0, 0, 0, wire.NO_SEAL) + b"x" * min(length, 11))
            _, req_id, status, _, message = read_reply(sock)
            assert (req_id, status) == (9, code), message
            assert message
            assert closed_by_node(sock), length  # its payload can't be skipped
    with node.connect() as sock:  # a READ of the wrong size leaves the connection usable
        put(node, b"r", 1, b"abc")
        sock.sendall(read_frame(b"r", 1, 4, req_id=1) + wire.pack_request(Op.PING, 2, b""))
        assert read_reply(sock)[1:3] == (1, Code.STALE)
        assert read_reply(sock)[1:3] == (2, Code.OK)
    status, message = write_status(node, b"pinned", 1, os.urandom(SEGMENT // 2 + 1), flags=WriteFlag.HARD_PIN)
    assert status == Code.NO_SPACE and "quota" in message


def _header(**fields) -> bytes:
    values = {"magic": wire.MAGIC, "version": wire.VERSION, "op": Op.READ, "req_id": 1, "key_len": 1, "flags": 0,
              "generation": 1, "arg": 0, "length": 1, "checksum": 0}
    values.update(fields)
    return wire.REQUEST.pack(*values.values())


def test_malformed_input_closes_only_that_connection(node):
    reference = os.urandom(100_000)
    put(node, b"ref", 1, reference)
    payload = os.urandom(50_000)
    cases = {
        "garbage": (os.urandom(64), False),
        "bad magic": (_header(magic=b"XX") + b"k", False),
        "bad version": (_header(version=99) + b"k", False),
        "huge key_len": (_header(key_len=60_000) + b"k" * 100, False),
        "unknown op": (_header(op=77) + b"k", False),
        "truncated header": (_header()[:10], True),
        "truncated key": (_header(key_len=50) + b"k" * 10, True),
        "truncated write options": (_header(op=Op.WRITE, length=10) + b"k" + b"\0" * 5, True),
        "truncated write payload": (write_frame(b"w", 1, payload)[:-20_000], True),
    }
    for name, (data, then_hang_up) in cases.items():
        with node.connect() as sock:
            sock.sendall(data)
            if then_hang_up:  # the peer leaves mid-frame
                sock.shutdown(socket.SHUT_WR)
            assert closed_by_node(sock), name
        assert node.proc.poll() is None, name
        assert get(node, b"ref", 1, len(reference)) == (Code.OK, reference), name
    # The truncated WRITE was never recorded and its extent was given back.
    assert get(node, b"w", 1, len(payload))[0] == Code.NOT_FOUND
    used = report(node)["tiers"]["dram"]["used"]
    assert used == len(reference) + (-len(reference)) % 64


def test_a_request_stalled_half_received_loses_its_connection_and_what_it_reserved(etcd, tmp_path):
    node = start_node(etcd, tmp_path, args=("--frame-timeout", "1"))
    try:
        payload = os.urandom(1 << 20)
        idle = node.connect()  # nothing sent: a connection between requests may wait as long as it likes
        stalled = {
            "header-only WRITE": write_frame(b"big", 1, payload)[:wire.REQUEST.size + 3 + wire.WRITE_OPTIONS.size],
            "WRITE with part of its payload": write_frame(b"big2", 2, payload)[:300_000],
            "part of a header": _header()[:10],
            "header without its key": _header(key_len=40),
        }
        socks = {}
        for name, data in stalled.items():
            socks[name] = node.connect()
            socks[name].sendall(data)  # then nothing more, without hanging up
        for name, sock in socks.items():
            assert closed_by_node(sock), name  # within the 10 s the harness waits (the timeout is 1 s)
            sock.close()
        assert report(node)["tiers"]["dram"]["used"] == 0  # the reserved extents were given back
        with idle:
            idle.sendall(write_frame(b"after", 3, payload))
            assert read_reply(idle)[2] == Code.OK
        assert get(node, b"after", 3, len(payload)) == (Code.OK, payload)
        assert "stalled half-received" in node.log()
    finally:
        node.stop()


def test_a_peer_that_stops_reading_its_replies_lets_go_of_what_it_asked_for(etcd, tmp_path):
    node = start_node(etcd, tmp_path, args=("--frame-timeout", "1"))
    try:
        value = os.urandom(4 << 20)
        put(node, b"big", 1, value)
        reader = node.connect()
        # 64 READs of 4 MiB, never read back: far more than the socket buffers hold, so the node's send
        # stalls with the object pinned for the transfer.
        reader.sendall(b"".join(read_frame(b"big", 1, len(value), req_id=i) for i in range(64)))
        assert free(node, b"big", 1) == Code.OK  # freed at once from the index; its extent waits for the reader
        wait_until(lambda: report(node)["tiers"]["dram"]["used"] == 0, 10, what="the stalled reader let go")
        assert "stalled" in node.log() or "took nothing" in node.log()
        reader.close()
        put(node, b"after", 2, value)  # and the node serves on
        assert get(node, b"after", 2, len(value)) == (Code.OK, value)
    finally:
        node.stop()


def test_a_compressed_write_whose_raw_size_lz4_cannot_produce_is_refused(node):
    payload = os.urandom(1000)
    status, message = write_status(node, b"liar", 1, payload, flags=WriteFlag.COMPRESSED, raw_size=2**40)
    assert status == Code.INVALID_ARGUMENT and "raw_size" in message
    assert get(node, b"liar", 1, len(payload))[0] == Code.NOT_FOUND
    status, message = write_status(node, b"plain", 2, payload, raw_size=999)  # uncompressed: raw is stored
    assert status == Code.INVALID_ARGUMENT and "raw_size" in message
    put(node, b"honest", 3, payload, flags=WriteFlag.COMPRESSED, raw_size=200_000)
    assert report(node)["tiers"]["dram"]["objects"] == 1


def test_unknown_op_gets_a_protocol_error_before_close(node):
    with node.connect() as sock:
        sock.sendall(_header(op=77, req_id=5) + b"k")
        assert read_reply(sock)[1:3] == (5, Code.PROTOCOL)
        assert closed_by_node(sock)


def test_report_and_inventory_describe_what_the_node_holds(node):
    put(node, b"plain", 1, os.urandom(1000))
    put(node, b"ttl", 2, os.urandom(2000), ttl_ms=600_000, raw_size=5000, flags=WriteFlag.COMPRESSED)
    put(node, b"pin", 3, os.urandom(3000), flags=WriteFlag.HARD_PIN)
    assert get(node, b"plain", 1, 1000)[0] == Code.OK
    assert get(node, b"nope", 1, 10)[0] == Code.NOT_FOUND
    got = report(node)
    assert set(got) == {"node_id", "tiers", "evicted", "tenants", "version"}  # "shared_fault" while one fails
    assert got["node_id"] == node.node_id and got["evicted"] == [] and got["version"] == kvpool.__version__
    assert got["tenants"] == {"": {"objects": 3, "dram_bytes": 6000, "ssd_bytes": 0, "hits": 1, "misses": 1,
                                   "evicted_quota": 0, "evicted_pressure": 0, "refused": 0}}  # keys of no tenant
    assert set(got["tiers"]) == {"dram"}  # no --ssd: no SSD tier
    dram = got["tiers"]["dram"]
    assert set(dram) == {"capacity", "used", "objects", "hits", "misses", "demotions", "promotions", "evictions",
                         "evicted_bytes", "watermark", "pinned_bytes", "fault", "faults"}
    assert (dram["fault"], dram["faults"]) == ("", 0)  # DRAM has no disk to fail
    assert (dram["capacity"], dram["objects"], dram["hits"], dram["misses"]) == (SEGMENT, 3, 1, 1)
    assert (dram["pinned_bytes"], dram["watermark"], dram["evictions"]) == (3000, "low", 0)
    assert dram["used"] == 1024 + 2048 + 3008  # 64-byte aligned extents

    inv = inventory(node)
    assert set(inv) == {("plain", 1), ("ttl", 2), ("pin", 3)}
    assert inv[("plain", 1)]["tiers"] == ["dram"] and inv[("plain", 1)]["ttl_ms"] == 0
    assert inv[("plain", 1)]["raw_size"] == 1000  # raw_size 0 means not compressed: the size itself
    ttl = inv[("ttl", 2)]
    assert (ttl["size"], ttl["raw_size"], ttl["flags"]) == (2000, 5000, WriteFlag.COMPRESSED)
    assert 0 < ttl["ttl_ms"] <= 600_000
    assert inv[("pin", 3)]["flags"] == WriteFlag.HARD_PIN
    assert set(ttl) == {"key", "generation", "size", "checksum", "flags", "raw_size", "ttl_ms", "tiers"}


def test_expired_objects_are_never_served_and_are_reported(node):
    data = os.urandom(1000)
    put(node, b"short", 1, data, ttl_ms=300)
    put(node, b"long", 1, data, ttl_ms=600_000)
    wait_until(lambda: get(node, b"short", 1, len(data))[0] == Code.NOT_FOUND, 10, what="ttl to lapse")
    assert get(node, b"long", 1, len(data)) == (Code.OK, data)
    evicted = wait_until(lambda: report(node)["evicted"], 10, what="expired object in REPORT")
    assert evicted == [["short", 1]]
    assert report(node)["evicted"] == []  # drained by the REPORT that returned it
    assert set(inventory(node)) == {("long", 1)}


def test_registers_in_etcd_and_leaves_on_sigterm(etcd, node):
    got = wait_until(lambda: etcd_get(etcd, node_key("default", node.node_id)), 10, what="node record")
    record = NodeRecord.from_json(got.value)
    assert (record.node_id, record.address, record.pid) == (node.node_id, f"{node.host}:{node.port}", node.proc.pid)
    assert set(record.tiers) == {"dram"}
    segment = record.tiers["dram"]
    assert segment.capacity == SEGMENT
    assert segment.path or not os.path.isdir("/dev/shm")
    if segment.path:  # /dev/shm backing: private to the node's user
        assert stat.S_IMODE(os.stat(segment.path).st_mode) == 0o600
        assert os.path.basename(segment.path) == f"kvpool-default-{node.node_id}-{record.instance}"

    node.proc.send_signal(signal.SIGTERM)
    assert node.proc.wait(15) == 0
    # The lease is 30 s, so a record gone right away means it was revoked on the way out.
    assert etcd_get(etcd, node_key("default", node.node_id)) is None
    assert not segment.path or not os.path.exists(segment.path)


def test_registers_again_after_losing_its_lease(etcd, tmp_path):
    node = start_node(etcd, tmp_path, node_id="n2", lease_ttl=3)
    try:
        key = node_key("default", "n2")
        first = etcd_get(etcd, key)
        host, port = parse_hostport(etcd)

        async def revoke():
            async with EtcdClient(host, port, member_credential()) as client:
                await client.revoke_lease(first.lease)
        asyncio.run(revoke())

        again = wait_until(lambda: etcd_get(etcd, key), 10, what="node to register again")
        assert again.lease != first.lease
        assert NodeRecord.from_json(again.value).address == f"{node.host}:{node.port}"
        node.proc.send_signal(signal.SIGINT)
        assert node.proc.wait(15) == 0
    finally:
        node.stop()


def test_ping_replies_with_the_node_id(node):
    _, req_id, status, value_checksum, body = call(node, wire.pack_request(Op.PING, 3, b""))
    assert (req_id, status, body) == (3, Code.OK, node.node_id.encode())
    assert value_checksum == checksum(body)


def test_connections_past_the_limit_are_turned_away_and_the_rest_served(etcd, tmp_path):
    node = start_node(etcd, tmp_path, args=("--max-connections", "20"))
    held = []
    try:
        put(node, b"kept", 1, b"v" * 1000)
        held = [node.connect() for _ in range(20)]
        for sock in held:  # each is being served (answered), so each counts
            sock.sendall(wire.pack_request(Op.PING, 1, b""))
            assert read_reply(sock)[2] == Code.OK
        with node.connect_raw() as extra:  # turned away before any challenge
            assert read_reply(extra)[2] == Code.UNAVAILABLE
            assert closed_by_node(extra)
        held.pop().close()
        def served():
            try:
                return get(node, b"kept", 1, 1000) == (Code.OK, b"v" * 1000)
            except UnavailableError:  # still at the limit: the node has not seen the close yet
                return False

        wait_until(served, 10, what="a connection served again once one left")
        assert node.proc.poll() is None
    finally:
        for sock in held:
            sock.close()
        node.stop()


def test_a_client_turned_away_gets_a_typed_error_naming_the_limit(etcd, tmp_path):
    from kvpool.errors import UnavailableError
    from kvpool.net.tcp_link import TcpLink
    from kvpool.security.auth import client_credential

    node = start_node(etcd, tmp_path, args=("--max-connections", "2"))
    held = [node.connect(), node.connect()]
    try:
        for sock in held:
            sock.sendall(wire.pack_request(Op.PING, 1, b""))
            assert read_reply(sock)[2] == Code.OK

        async def ping():
            transport = TcpLink(credential=client_credential())
            try:
                await ping_node(transport, f"{node.host}:{node.port}")
            finally:
                await transport.close()

        with pytest.raises(UnavailableError, match="limit of 2 connections"):
            asyncio.run(ping())
    finally:
        for sock in held:
            sock.close()
        node.stop()


def test_idle_timeout_closes_quiet_connections_only(etcd, tmp_path):
    node = start_node(etcd, tmp_path, node_id="idle", args=("--idle-timeout", "1"))
    try:
        put(node, b"kept", 1, b"k" * 100)
        with node.connect() as quiet, node.connect() as busy:
            quiet.settimeout(0.2)  # each look at it waits this long, while busy keeps talking

            def quiet_closed():
                busy.sendall(wire.pack_request(Op.PING, 1, b""))  # keeps this one in use meanwhile
                assert read_reply(busy)[2] == Code.OK
                return closed_by_node(quiet)

            wait_until(quiet_closed, 15, interval=0.1, what="the quiet connection to be closed")
            busy.sendall(wire.pack_request(Op.PING, 2, b""))  # the one in use was never closed
            assert read_reply(busy)[1:3] == (2, Code.OK)
        assert get(node, b"kept", 1, 100) == (Code.OK, b"k" * 100)
    finally:
        node.stop()


def test_a_write_asking_to_live_past_100_years_is_refused_before_any_room_is_taken(etcd, tmp_path):
    """A TTL or pin that would not fit the SSD header (e.g. a client's ttl of 1.8e16 s) is refused at admission,
    on a node writing to SSD: nothing reserved, nothing lost, the node serving on (before, the header pack failed
    after the payload arrived and the extent stayed reserved until restart)."""
    node = start_node(etcd, tmp_path, args=("--ssd", "8MiB", "--data-dir", str(tmp_path / "ssd-node")))
    try:
        payload = b"s" * 4000
        before = report(node)["tiers"]["ssd"]
        for options in ({"ttl_ms": 18 * 10**18}, {"soft_pin_ms": 10**16}, {"ttl_ms": 2**63}):
            status, message = write_status(node, b"forever", 1, payload, flags=WriteFlag.PREFER_SSD, **options)
            assert status == Code.INVALID_ARGUMENT and "100 years" in message, message
        assert report(node)["tiers"]["ssd"]["used"] == before["used"]
        put(node, b"ten-years", 2, payload, flags=WriteFlag.PREFER_SSD, ttl_ms=10 * 365 * 86400 * 1000)
        assert get(node, b"ten-years", 2, len(payload)) == (Code.OK, payload)
        assert report(node)["tiers"]["ssd"]["used"] > before["used"]
    finally:
        node.stop()
    assert "Traceback" not in node.log()


def test_inventory_changes_read_only_what_changed_and_only_by_a_member(node):
    from kvpool.errors import ForbiddenError
    from kvpool.net.tcp_link import TcpLink
    from kvpool.security.auth import client_credential

    address = f"{node.host}:{node.port}"

    async def changes(since: int, credential=None):
        transport = TcpLink(credential=credential or member_credential())
        try:
            return await transport.inventory_changes(address, since)
        finally:
            await transport.close()

    for i in range(3):
        put(node, f"k{i}".encode(), i + 1, os.urandom(100))
    first = asyncio.run(changes(0))
    assert sorted(e.key for e in first.reply) == ["k0", "k1", "k2"] and first.gone.size == 0
    assert free(node, b"k1", 2) == Code.OK
    put(node, b"k3", 4, os.urandom(100))
    later = asyncio.run(changes(first.changes))
    assert later.series == first.series and later.changes > first.changes
    assert [e.key for e in later.reply] == ["k3"]
    slot_of = dict(zip((e.key for e in first.reply), first.slots.tolist()))
    assert later.slots.tolist() == [slot_of["k1"]] or later.gone.tolist() == [slot_of["k1"]]  # k3 may reuse it
    with pytest.raises(ForbiddenError):
        asyncio.run(changes(0, client_credential()))
    assert report(node)["tiers"]["dram"]["objects"] == 3  # a standby's read (term 0) changed nothing
