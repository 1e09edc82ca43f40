"""etcd as kvpool runs it: its peer port takes only the members' own certificate (a lone member's listens on
127.0.0.1), and masters and nodes of a cluster with a secret refuse an etcd with authentication off unless
told to allow it."""

import os
import socket
import ssl
import subprocess
import sys
import urllib.request

import pytest

from kvpool.launch.etcd_server import PEER_TLS_DIR, EtcdServer
from kvpool.launch.local_cluster import Child
from kvpool.security.tls import TlsFiles

KVPOOL = [sys.executable, "-m", "kvpool.commands.cli"]
CLIENT_HOST = "127.0.0.2"  # another loopback address: where a lone member's clients reach it, not its peers


@pytest.fixture
def open_etcd(tmp_path):
    """An etcd with authentication off (no `kvpool etcd-auth`), its client port on CLIENT_HOST."""
    server = EtcdServer(tmp_path / "etcd", host=CLIENT_HOST, log_path=tmp_path / "etcd.log").start()
    yield server
    server.stop()


def _members(url: str, context) -> bytes:
    with urllib.request.urlopen(f"{url}/members", timeout=5, context=context) as reply:
        return reply.read()


def test_a_lone_members_peer_port_is_on_localhost_and_takes_only_its_certificate(open_etcd, tmp_path):
    assert open_etcd.peer_url == f"https://127.0.0.1:{open_etcd.peer_port}"
    with pytest.raises(ConnectionRefusedError):  # not where its clients reach it
        socket.create_connection((CLIENT_HOST, open_etcd.peer_port), timeout=5).close()
    material = tmp_path / PEER_TLS_DIR
    assert (material.stat().st_mode & 0o777) == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in material.iterdir()} == \
        {"ca.pem": 0o600, "cert.pem": 0o600, "key.pem": 0o600}
    files = TlsFiles.in_dir(material)
    member = files.client_context()
    member.load_cert_chain(files.cert, files.key)
    assert b"kvpool-etcd" in _members(open_etcd.peer_url, member)  # a member's certificate is taken
    stranger = ssl.create_default_context()
    stranger.check_hostname, stranger.verify_mode = False, ssl.CERT_NONE
    with pytest.raises(OSError):  # TLS without a certificate: the handshake is refused
        _members(open_etcd.peer_url, stranger)
    with pytest.raises(OSError):  # plain HTTP: nothing answered
        _members(open_etcd.peer_url.replace("https:", "http:"), None)


def _refused(argv: list) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr[-3000:]
    return done.stderr.strip().splitlines()[-1]


def test_a_master_refuses_an_etcd_without_authentication_unless_allowed(open_etcd, tmp_path):
    assert os.environ.get("KVPOOL_TOKEN")  # the suite's cluster secret (tests/conftest.py)
    argv = [*KVPOOL, "master", "--etcd", open_etcd.endpoint, "--host", "127.0.0.1", "--port", "0"]
    line = _refused(argv)
    assert line.startswith(f"kvpool-master: etcd at {open_etcd.endpoint} has authentication off"), line
    assert f"kvpool etcd-auth --etcd {open_etcd.endpoint}" in line and "--allow-etcd-without-auth" in line
    allowed = Child("master", [*argv, "--allow-etcd-without-auth"], tmp_path).start(60)
    try:
        assert allowed.alive
    finally:
        allowed.stop()


def test_a_storage_node_refuses_an_etcd_without_authentication_unless_allowed(open_etcd, tmp_path):
    argv = [*KVPOOL, "storenode", "--etcd", open_etcd.endpoint, "--host", "127.0.0.1", "--port", "0",
            "--dram", "16MiB", "--node-id", "open-etcd", "--etcd-wait", "20"]
    line = _refused(argv)
    assert line.startswith(f"kvpool-storenode: etcd at {open_etcd.endpoint} has authentication off"), line
    os.environ["KVPOOL_CLUSTER_ALLOW_ETCD_WITHOUT_AUTH"] = "true"  # the setting of [cluster], as a variable
    try:
        allowed = Child("node", argv, tmp_path).start(60)
    finally:
        del os.environ["KVPOOL_CLUSTER_ALLOW_ETCD_WITHOUT_AUTH"]
    try:
        assert allowed.alive
    finally:
        allowed.stop()


def test_kvpool_tls_etcd_peers_makes_material_a_member_serves_its_peer_port_with(tmp_path):
    """The operator's step (docker-compose.yml, deploy/kubernetes): `kvpool tls DIR --etcd-peers`."""
    material = tmp_path / "operator-made"
    made = subprocess.run([*KVPOOL, "tls", str(material), "--etcd-peers", "--hosts", "127.0.0.1"],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and "--peer-client-cert-auth" in made.stdout, made.stderr
    assert {p.name: p.stat().st_mode & 0o777 for p in material.iterdir()} == \
        {"ca.pem": 0o600, "cert.pem": 0o600, "key.pem": 0o600}
    files = TlsFiles.in_dir(material)
    server = EtcdServer(tmp_path / "etcd", log_path=tmp_path / "etcd.log", peer_tls=files).start()
    try:
        member = files.client_context()
        member.load_cert_chain(files.cert, files.key)
        assert b"kvpool-etcd" in _members(server.peer_url, member)
        assert not (tmp_path / PEER_TLS_DIR).exists()  # the material given, none made
    finally:
        server.stop()


def test_a_port_taken_between_choosing_it_and_binding_it_is_chosen_again(tmp_path):
    server = EtcdServer(tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    taken = server.client_port
    with socket.socket() as squatter:  # another process binds the port etcd was given first
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        server.start()
        try:
            assert server.client_port != taken and "address already in use" in (tmp_path / "etcd.log").read_text()
            with urllib.request.urlopen(f"http://{server.endpoint}/health", timeout=5) as answer:
                assert b'"true"' in answer.read()
        finally:
            server.stop()
