"""The project's docker-compose.yml run for real: kvpool's image built here with no registry
(deploy/image/build.sh), `docker-compose up` of etcd, a master, three storage nodes and the bench client on a
Docker engine of the test's own (docker_engine.py), the health checks waited on, the bench client's results
checked, a storage container killed with reads going on from the other copies, started again, and
`docker-compose down -v` leaving no container, network or volume behind."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from docker_engine import DockerEngine, unavailable
from kvpool.net.netutil import wait_until

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "kvpooltest"
SERVICES = ("etcd", "master", "node1", "node2", "node3")
PROBE = '''
import hashlib, json, sys
from kvpool import Client
phase, count = sys.argv[1], int(sys.argv[2])
keys = [f"compose/{i:04d}" for i in range(count)]
def value(key): return hashlib.sha256(key.encode()).digest() * 2048  # 64 KiB, different for every key
with Client(etcd="etcd:2379", replicas=2, timeout=20) as client:
    if phase == "put":
        client.batch_put(keys, [value(key) for key in keys])
    got = client.batch_get(keys)
    print(json.dumps({"right": sum(g == value(k) for k, g in zip(keys, got)), "missing": got.count(None),
                      "nodes": len(client.stats().nodes)}))
'''


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    why = unavailable()
    if why:
        pytest.skip(why)
    root = Path(os.environ.get("KVPOOL_TEST_DOCKER_ROOT") or tmp_path_factory.mktemp("docker"))
    started = DockerEngine(root)
    try:
        started.start()
    except (RuntimeError, TimeoutError) as exc:  # this machine cannot run an engine: said, not failed
        started.stop()
        pytest.skip(f"a Docker engine cannot run here: {exc}")
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def image(engine):
    """kvpool:latest, built once per run over a debootstrapped base."""
    began = time.monotonic()
    subprocess.run([str(ROOT / "deploy" / "image" / "build.sh")], env={**engine.env, "PYTHON": sys.executable},
                   check=True, timeout=1200)
    print(f"image built in {time.monotonic() - began:.0f} s")
    return "kvpool:latest"


def project_dir(tmp_path: Path) -> Path:
    """The compose file beside the secrets and TLS material its header says to make, in a directory of its own."""
    shutil.copy(ROOT / "docker-compose.yml", tmp_path / "docker-compose.yml")
    kvpool = [sys.executable, "-m", "kvpool.commands.cli"]
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    secret = secrets / "kvpool.secret"
    secret.touch(mode=0o600)
    secret.write_text(subprocess.run([*kvpool, "token", "new"], check=True, capture_output=True, text=True).stdout)
    client = secrets / "client.token"
    client.touch(mode=0o600)
    client.write_text(subprocess.run([*kvpool, "token", "client", "--token-file", str(secret)], check=True,
                                     capture_output=True, text=True).stdout)
    subprocess.run([*kvpool, "tls", str(secrets / "tls"), "--hosts", "etcd,master,node1,node2,node3"], check=True,
                   capture_output=True)
    subprocess.run([*kvpool, "tls", str(secrets / "etcd-peer"), "--etcd-peers", "--hosts", "etcd"], check=True,
                   capture_output=True)
    (tmp_path / "probe.py").write_text(PROBE)
    return tmp_path


def health(engine: DockerEngine, container: str) -> str:
    return engine.docker("inspect", "--format", "{{.State.Health.Status}}", container, capture=True,
                         check=False).stdout.strip()


def container(service: str) -> str:
    return f"{PROJECT}_{service}_1"


def probe(engine: DockerEngine, where: Path, phase: str, count: int = 200) -> dict:
    """The probe run as a client inside the compose network (the bench service's image, token and CA)."""
    done = engine.compose(where, PROJECT, "run", "--rm", "--no-deps", "-v", f"{where / 'probe.py'}:/probe.py:ro",
                          "--entrypoint", "python", "bench", "/probe.py", phase, str(count), timeout=120)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(1500)  # the image (debootstrap and a build, ~2 min) and the cluster's whole life (~5 min)
def test_the_compose_cluster_serves_survives_a_node_and_leaves_nothing_behind(engine, image, tmp_path):
    where = project_dir(tmp_path)
    try:
        began = time.monotonic()
        engine.compose(where, PROJECT, "up", "-d", "--no-build", timeout=300)  # waits on etcd's health itself
        wait_until(lambda: all(health(engine, container(s)) == "healthy" for s in SERVICES), 120,
                   what="every service's health check to pass")
        print(f"compose up and healthy in {time.monotonic() - began:.0f} s")

        # The bench client ran once every service was healthy: its one JSON line is its result.
        wait_until(lambda: engine.docker("inspect", "--format", "{{.State.Status}}", container("bench"),
                                         capture=True).stdout.strip() == "exited", 300, what="the bench client")
        assert engine.docker("inspect", "--format", "{{.State.ExitCode}}", container("bench"),
                             capture=True).stdout.strip() == "0"
        logs = engine.compose(where, PROJECT, "logs", "--no-color", "bench").stdout
        bench = json.loads(next(line.split("|", 1)[1] for line in reversed(logs.splitlines())
                                if line.split("|", 1)[-1].strip().startswith("{")))
        print("compose bench:", json.dumps(bench["results"]))
        assert bench["settings"]["security"] == {"authenticated": True, "tls": True}
        ops = {(row["op"], row["size"]) for row in bench["results"]}
        assert {("put", 65536), ("get", 65536), ("get_into", 4194304), ("batch_get_into", 1048576)} <= ops
        assert all(row["MBps"] > 0 for row in bench["results"]), bench["results"]
        assert bench["transports"]["tcp"]["batch_exists_latency"]["all_existed"]

        assert probe(engine, where, "put") == {"right": 200, "missing": 0, "nodes": 3}
        engine.docker("kill", container("node2"), capture=True)
        assert probe(engine, where, "get") == {"right": 200, "missing": 0, "nodes": 2}  # the other copies
        engine.compose(where, PROJECT, "start", "node2")
        wait_until(lambda: health(engine, container("node2")) == "healthy", 120, what="node2 healthy again")
        assert probe(engine, where, "get")["nodes"] == 3
    finally:
        down = engine.compose(where, PROJECT, "down", "-v", "--remove-orphans", check=False, timeout=300)
    assert down.returncode == 0, down.stderr
    assert engine.docker("ps", "-aq", capture=True).stdout.split() == []
    networks = engine.docker("network", "ls", "--format", "{{.Name}}", capture=True).stdout.split()
    assert [n for n in networks if n.startswith(PROJECT)] == []
    assert [v for v in engine.docker("volume", "ls", "-q", capture=True).stdout.split() if v.startswith(PROJECT)] == []
