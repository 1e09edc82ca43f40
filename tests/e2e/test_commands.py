"""Commands and options a deployment uses that `kvpool up` does not: `kvpool router`, `kvpool etcd-auth` and
`kvpool tls` with `kvpool master` / `kvpool storenode` given `--tls-dir`, and `--advertise-host`, each run as
its own process the way an operator runs it; and what `kvpool up`, `kvpool master` and `kvpool storenode` say
when they cannot start (a port taken, etcd unreachable): one last line naming the cause and the fix."""

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from storenode_harness import client_credential, member_credential

from kvpool import Client
from kvpool.connectors.block_keys import BlockNamespace, block_hashes
from kvpool.cluster.etcd_client import EtcdClient
from kvpool.launch.etcd_server import EtcdServer
from kvpool.launch.local_cluster import Child, stop_process
from kvpool.net.netutil import wait_until
from kvpool.security import auth

KVPOOL = [sys.executable, "-m", "kvpool.commands.cli"]
BS = 4


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _client_token() -> dict:
    """The header that proves the cluster's client token (the router asks it on every path but the probes)."""
    return {"Authorization": f"Bearer {auth.client_token(os.environ['KVPOOL_TOKEN'])}"}


def _get_json(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=_client_token()), timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _post_json(url: str, body) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **_client_token()})
    with urllib.request.urlopen(request, timeout=10) as reply:
        return reply.status, json.loads(reply.read())


def test_the_router_command_follows_the_pool_and_answers_routes_and_probes(cluster):
    namespace = BlockNamespace("router-cmd", "float32", "vllm-nhd", BS)
    prompt = list(range(3 * BS)) + [1]
    router = subprocess.Popen([*KVPOOL, "router", "--master", cluster.master_address, "--namespace",
                               namespace.prefix(), "--engine", "a=", "--engine", "b=", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = router.stdout.readline()
        match = re.match(r"kvpool router ready (http://127\.0\.0\.1:\d+) engines=a,b$", line.strip())
        assert match, line + router.stderr.read()
        url = match.group(1)
        assert _get_json(f"{url}/healthz") == (200, {"ok": True})
        assert _get_json(f"{url}/readyz") == (200, {"ok": True})
        with pytest.raises(urllib.error.HTTPError) as refused:  # without the client token
            urllib.request.urlopen(f"{url}/engines", timeout=10)
        assert refused.value.code == 401
        with Client(cluster.master_address) as client:
            client.batch_put([namespace.key(h) for h in block_hashes(prompt, BS)[:2]], [b"kv"] * 2)
            wait_until(lambda: _get_json(f"{url}/engines")[1]["pool_blocks"] == 2, 20,
                       what="the router to follow the pool's blocks")
            status, answer = _post_json(f"{url}/route", {"token_ids": prompt})
            assert status == 200 and answer["engine"] in ("a", "b")
            # Neither engine holds a block; both could load the two the pool holds.
            assert sorted((s["engine"], s["local_blocks"], s["pool_blocks"]) for s in answer["scores"]) == \
                [("a", 0, 2), ("b", 0, 2)]
            client.remove_prefix(namespace.prefix())
        wait_until(lambda: _get_json(f"{url}/engines")[1]["pool_blocks"] == 0, 20,
                   what="the router to see the blocks go")
    finally:
        assert stop_process(router, 20) == 0, router.stderr.read()[-3000:]


def _etcd_roles(endpoint: str, tls=None) -> dict:
    """What each credential may do on etcd: {"member": (write, read), "client": ..., "nobody": ...}."""
    host, port = _hostport(endpoint)

    async def able(credential) -> tuple[bool, bool]:
        outcome = []
        client = EtcdClient(host, port, credential, timeout=5, tls=tls)
        try:
            for step in (lambda: client.put(b"/kvpool/probe", b"1"), lambda: client.get(b"/kvpool/probe")):
                try:
                    await step()
                    outcome.append(True)
                except Exception:  # noqa: BLE001 - refused, whatever etcd's error type
                    outcome.append(False)
        finally:
            await client.close()
        return tuple(outcome)

    async def main():
        return {"member": await able(member_credential()), "client": await able(client_credential()),
                "nobody": await able(None)}

    return asyncio.run(main())


def test_etcd_auth_turns_on_the_cluster_users_of_a_plain_etcd(tmp_path):
    server = EtcdServer(tmp_path / "etcd", log_path=tmp_path / "etcd.log").start()
    try:
        assert _etcd_roles(server.endpoint)["nobody"] == (True, True)  # open before
        first = subprocess.run([*KVPOOL, "etcd-auth", "--etcd", server.endpoint], capture_output=True, text=True,
                               timeout=60)
        assert (first.returncode, first.stdout.strip()) == (0, "etcd authentication turned on"), first.stderr
        assert _etcd_roles(server.endpoint) == {"member": (True, True), "client": (False, True),
                                                "nobody": (False, False)}
        no_secret = subprocess.run([*KVPOOL, "etcd-auth", "--etcd", server.endpoint], capture_output=True,
                                   text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                               if k not in ("KVPOOL_TOKEN", "KVPOOL_TOKEN_FILE")})
        assert no_secret.returncode == 1 and "no cluster secret" in no_secret.stderr
    finally:
        server.stop()


def test_tls_dir_on_etcd_auth_master_and_storenode_commands(tmp_path):
    """What a deployment does by hand: `kvpool tls`, etcd over TLS, `kvpool etcd-auth --tls-dir`, then
    `kvpool master` and `kvpool storenode` with --tls-dir; a client with the CA stores and reads."""
    from kvpool.security.tls import TlsFiles

    tls_dir = tmp_path / "tls"
    made = subprocess.run([*KVPOOL, "tls", str(tls_dir), "--hosts", "127.0.0.1,localhost"], capture_output=True,
                          text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    files = TlsFiles.in_dir(tls_dir)
    server = EtcdServer(tmp_path / "etcd", log_path=tmp_path / "etcd.log", tls=files).start()
    children = []
    try:
        auth_on = subprocess.run([*KVPOOL, "etcd-auth", "--etcd", server.endpoint, "--tls-dir", str(tls_dir)],
                                 capture_output=True, text=True, timeout=60)
        assert auth_on.returncode == 0 and "turned on" in auth_on.stdout, auth_on.stderr
        assert _etcd_roles(server.endpoint, tls=files)["nobody"] == (False, False)
        logs = tmp_path / "logs"
        logs.mkdir()
        common = ["--etcd", server.endpoint, "--tls-dir", str(tls_dir)]
        children.append(Child("master", [*KVPOOL, "master", *common, "--port", "0"], logs).start(60))
        children.append(Child("node", [*KVPOOL, "storenode", *common, "--dram", "32MiB", "--node-id", "n0",
                                       "--lease-ttl", "2"], logs).start(60))
        master = children[0].info["address"]
        with Client(master, tls_ca=str(files.ca), transports="tcp") as client:
            wait_until(lambda: len(client.stats().nodes) == 1, 20, what="the node to join")
            client.put("tls-dir/k", b"v" * 70_000)
            assert client.get("tls-dir/k") == b"v" * 70_000
        with pytest.raises(Exception):  # noqa: B017 - the master speaks nothing but TLS
            with Client(master, tls_ca="", rpc_timeout=3) as plain:
                plain.get("tls-dir/k")
    finally:
        for child in reversed(children):
            child.stop()
        server.stop()


def _connected_to(host: str, port: int) -> bool:
    """Whether an established TCP connection has host:port as its local end (the server's side of it)."""
    wanted = "%08X:%04X" % (int.from_bytes(bytes(map(int, host.split("."))), "little"), port)
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return any(row.split()[1] == wanted and row.split()[3] == "01" for row in rows)


def test_advertise_host_is_the_address_clients_are_given_and_use(own_cluster):
    """Master and node listen on every address but advertise 127.0.0.2 (a loopback alias Linux routes): etcd's
    records, the master's ready line and Stats name it, and clients reach both there."""
    advertised = ["--host", "0.0.0.0", "--advertise-host", "127.0.0.2"]
    cluster = own_cluster(nodes=1, master_args=advertised, node_args=advertised)
    master, control = cluster.master.info["address"], cluster.master.info["control"]
    node = cluster.nodes[0].info["address"]
    assert [a.split(":")[0] for a in (master, control, node)] == ["127.0.0.2"] * 3
    with Client(etcd=cluster.etcd_endpoint, transports="tcp") as client:  # the master's record in etcd
        client.put("advertised/k", b"a" * 50_000)
        assert client.get("advertised/k") == b"a" * 50_000
        assert [n.address for n in client.stats().nodes] == [node]
        assert client.bytes_by_transport() == {"tcp": 100_000}
        # The connections this client made went to the advertised addresses, not to 127.0.0.1.
        for address in (control, node):
            host, port = _hostport(address)
            assert _connected_to(host, port), address
            assert not _connected_to("127.0.0.1", port), address


def _held_port(reuse_port: bool) -> socket.socket:
    """A listening socket on 127.0.0.1; with reuse_port it is bound as a gRPC server binds its port
    (SO_REUSEPORT), so that only a server that refuses to share it notices it is taken."""
    sock = socket.socket()
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    return sock


def _last_stderr_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert lines, result
    return lines[-1]


@pytest.mark.parametrize("reuse_port", [False, True], ids=["plain", "shared-like-grpc"])
def test_up_on_a_master_port_already_taken_fails_naming_the_port_and_the_flag(tmp_path, reuse_port):
    with _held_port(reuse_port) as held:
        port = held.getsockname()[1]
        result = subprocess.run([*KVPOOL, "up", "--nodes", "1", "--dram-per-node", "32MiB", "--master-port", str(port),
                                 "--data-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert result.returncode not in (0, None), result
    assert "kvpool ready" not in result.stdout, result
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    line = _last_stderr_line(result)
    assert line.startswith("kvpool up: "), result.stderr[-3000:]
    for words in (f"127.0.0.1:{port}", "in use", "another --master-port"):
        assert words in line, (words, line)


def test_master_and_storenode_that_cannot_start_end_with_cause_and_fix(etcd, tmp_path):
    def run(*args: str) -> str:
        result = subprocess.run([*KVPOOL, *args], capture_output=True, text=True, timeout=120)
        assert result.returncode not in (0, None), result
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        return _last_stderr_line(result)

    with _held_port(reuse_port=True) as held:
        port = str(held.getsockname()[1])
        taken = {"master": run("master", "--etcd", etcd, "--host", "127.0.0.1", "--port", port),
                 "storenode": run("storenode", "--etcd", etcd, "--host", "127.0.0.1", "--port", port, "--dram", "16MiB",
                                  "--data-dir", str(tmp_path / "node"))}
    for program, line in taken.items():
        assert line.startswith(f"kvpool-{program}: cannot listen on 127.0.0.1:{port}: "), line
        assert "in use" in line and "another --port" in line, line
    with socket.socket() as gone:
        gone.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{gone.getsockname()[1]}"  # nothing listens there once closed
    unreachable = {"master": run("master", "--etcd", dead, "--port", "0"),
                   "storenode": run("storenode", "--etcd", dead, "--port", "0", "--dram", "16MiB",
                                    "--data-dir", str(tmp_path / "node"), "--etcd-wait", "1")}
    for program, line in unreachable.items():
        assert line.startswith(f"kvpool-{program}: cannot reach etcd at {dead}"), line
        assert "--etcd" in line, line
