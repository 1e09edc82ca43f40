"""The `kvpool` command as a user runs it, and the compose topology as processes."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from storenode_harness import metric_samples, metric_total

from kvpool.launch.local_cluster import stop_process
from kvpool.net.netutil import wait_until

ROOT = Path(__file__).resolve().parents[2]
KVPOOL = [sys.executable, "-m", "kvpool.commands.cli"]


def test_up_demo_does_real_work_and_exits_cleanly(tmp_path):
    result = subprocess.run([*KVPOOL, "up", "--demo", "--exit-after-demo", "--nodes", "2",
                             "--dram-per-node", "64MiB", "--data-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^kvpool ready master=127\.0\.0\.1:\d+ etcd=127\.0\.0\.1:\d+$", out, re.M), out
    assert "loaded them back" in out and ", 0 wrong" in out, out
    assert "64 of 65 keys exist" in out and "removed 64 keys by prefix" in out, out
    assert re.search(r"^node-0\s+127\.0\.0\.1:\d+\s+DRAM\s+64MiB", out, re.M), out


def test_up_runs_until_sigterm_then_stops_every_child(tmp_path):
    proc = subprocess.Popen([*KVPOOL, "up", "--nodes", "1", "--dram-per-node", "32MiB", "--data-dir",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvpool ready master="), line + proc.stderr.read()
        master = re.search(r"master=(\S+)", line).group(1)

        status = subprocess.run([*KVPOOL, "status", "--master", master], capture_output=True, text=True,
                                timeout=60)
        assert status.returncode == 0, status.stderr
        assert "1 nodes" in status.stdout and re.search(r"node-0\s+127\.0\.0\.1:\d+\s+DRAM\s+32MiB", status.stdout)

        pids = _children(proc.pid)
        assert len(pids) >= 3  # etcd, master, storage node
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        wait_until(lambda: not any(_running(p) for p in pids), timeout=15, what="every child to exit")
    finally:
        stop_process(proc, 30)  # SIGTERM first: `kvpool up` then stops its children (own sessions)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except FileNotFoundError:
        return False
    return state != "Z"


BASE_OPS = {"put", "get", "get_into", "batch_put", "batch_get_into"}


def _bench(*args: str, env: dict | None = None) -> tuple[int, dict, str]:
    result = subprocess.run([*KVPOOL, "bench", *args], capture_output=True, text=True, timeout=180, env=env)
    return result.returncode, json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


def test_bench_all_transports_on_the_same_values_each_under_its_own_name(own_cluster):
    """shm, UCX and TCP each run, each under its own name, and what the bench says each moved is what the
    client counted per transport and what the nodes counted on their side."""
    cluster = own_cluster(nodes=2, dram_per_node="192MiB", metrics=True,
                          node_args=["--transports", "shm,ucx,tcp"])
    node_urls = [url for name, url in cluster.metrics_urls.items() if name.startswith("node-")]
    before = [metric_samples(url) for url in node_urls]
    code, report, stderr = _bench("--master", cluster.master_address, "--transport", "all",
                                  "--sizes", "1MiB", "--batch", "8", "--seconds", "0.1")
    assert code == 0, stderr[-3000:]
    after = [metric_samples(url) for url in node_urls]
    assert report["baseline"]["socket_stream_MBps"] > 0 and report["baseline"]["memcpy_MBps"] > 0
    runs = report["transports"]
    assert set(runs) == {"shm", "ucx", "tcp"} and report["skipped"] == {}  # the nodes offer all three here
    # put, get and get_into of 1 MiB, batch_put and batch_get_into of 8 x 1 MiB, at least once each.
    least = (3 + 2 * 8) << 20
    for name, run in runs.items():
        assert run["bytes_by_transport"].keys() == {name} and run["bytes_by_transport"][name] >= least, name
    # The client's count per transport and the nodes' own count of value bytes in and out agree exactly.
    node_bytes = sum(metric_total(a, name) - metric_total(b, name) for a, b in zip(after, before)
                     for name in ("kvpool_node_bytes_in_total", "kvpool_node_bytes_out_total"))
    assert node_bytes == sum(run["bytes_by_transport"][name] for name, run in runs.items())
    for name, run in runs.items():
        assert 0 < run["get_latency"]["p50_us"] <= run["get_latency"]["p99_us"]
        ops = {(r["op"], r["size"]) for r in report["results"] if r["transport"] == name}
        assert {(op, 1 << 20) for op in BASE_OPS} <= ops
    for row in report["results"]:
        assert row["MBps"] > 0 and row["ratio_to_socket"] > 0
        assert ("ratio_to_memcpy" in row) == (row["transport"] == "shm")  # shm never touches a socket
    assert report["targets"]["shm get_into 4MiB / memcpy"]["met"] is None  # 4MiB was not run
    assert report["targets"]["shm get 64KiB p50 (warm placement cache)"]["p50_us"] > 0
    assert "target tcp batch_get_into 8 x 1MiB / socket" in stderr
    for name, run in runs.items():  # puts of keys that never existed, and batch_exists, per transport
        assert 0 < run["put_fresh_latency"]["p50_us"] <= run["put_fresh_latency"]["p99_us"]
        exists = run["batch_exists_latency"]
        assert exists["keys"] == 32 and exists["all_existed"] and 0 < exists["p50_us"] <= exists["p99_us"]
        fresh = {(r["op"], r["size"], r.get("batch")): r["MBps"] for r in report["results"]
                 if r["transport"] == name and "fresh" in r["op"]}
        assert set(fresh) == {("put_fresh", 64 << 10, None), ("put_fresh", 1 << 20, None),
                              ("put_from_fresh", 1 << 20, None), ("batch_put_from_fresh", 1 << 20, 8)}
        assert all(mbps > 0 for mbps in fresh.values())
        put = report["targets"][f"{name} put fresh 64KiB p50"]
        assert put["aim_us"] == 400 and put["mooncake_us"] == 393
        assert report["targets"][f"{name} batch_put_from fresh 8 x 1MiB"]["mooncake_MBps"] == 1777
        assert report["targets"][f"{name} batch_exists 32 keys p50"]["aim_us"] == 300
    assert "target tcp put fresh 64KiB p50" in stderr
    # Fresh keys are removed as the bench goes: nothing of its own is left in the cluster.
    from kvpool import Client

    with Client(cluster.master_address) as client:
        assert client.remove_prefix("bench/") == 0


def test_bench_names_a_default_run_after_the_transport_that_carried_its_bytes(cluster):
    env = {**os.environ, "KVPOOL_TRANSPORTS": "tcp"}
    code, report, stderr = _bench("--master", cluster.master_address, "--sizes", "64KiB", "--batch", "4",
                                  "--seconds", "0.1", env=env)
    assert code == 0, stderr[-3000:]
    assert list(report["transports"]) == ["tcp"] and report["skipped"] == {}
    assert {r["transport"] for r in report["results"]} == {"tcp"}


def test_bench_refuses_an_unknown_transport(cluster):
    result = subprocess.run([*KVPOOL, "bench", "--master", cluster.master_address, "--transport", "rdma"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "invalid choice: 'rdma'" in result.stderr


def test_bench_never_reports_bytes_of_another_transport_under_the_name_asked_for():
    from kvpool.commands.bench import Skipped, _carrier

    assert _carrier({"shm": 10, "tcp": 0}, "shm") == "shm"
    assert _carrier({"tcp": 10}, None) == "tcp"
    assert _carrier({"tcp": 1, "shm": 1}, None) == "shm+tcp"  # a default run that used both says so
    for moved, wanted in (({"tcp": 10}, "ucx"), ({"ucx": 5, "tcp": 10}, "ucx"), ({}, "shm"), ({}, None)):
        with pytest.raises(Skipped):
            _carrier(moved, wanted)


def test_compose_file_is_valid():
    checker = Path(sys.executable).parent / "check-jsonschema"
    result = subprocess.run([str(checker), "--builtin-schema", "vendor.compose-spec",
                             str(ROOT / "docker-compose.yml")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_etcd_peer_port_takes_only_its_members_certificate():
    """etcd in docker-compose.yml speaks https on its peer port and takes only a certificate of the CA in
    secrets/etcd-peer (`kvpool tls secrets/etcd-peer --etcd-peers`, as its header says), mounted in etcd alone."""
    import yaml

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    flags = dict(a.split("=", 1) if "=" in a else (a, "") for a in services["etcd"]["command"])
    assert "--peer-client-cert-auth" in flags
    peer_urls = [flags["--listen-peer-urls"], flags["--initial-advertise-peer-urls"],
                 *(m.split("=", 1)[1] for m in flags["--initial-cluster"].split(","))]
    assert all(url.startswith("https://") for url in peer_urls), peer_urls
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services["etcd"]["volumes"]}
    for flag, name in (("--peer-trusted-ca-file", "ca.pem"), ("--peer-cert-file", "cert.pem"),
                       ("--peer-key-file", "key.pem")):
        directory, file = flags[flag].rsplit("/", 1)
        assert (mounts[directory], file) == ("./secrets/etcd-peer", name), flag
    holders = {n for n, s in services.items() for v in s.get("volumes", []) if v.startswith("./secrets/etcd-peer")}
    assert holders == {"etcd"}
    assert "kvpool tls secrets/etcd-peer --etcd-peers" in (ROOT / "docker-compose.yml").read_text()


def test_compose_topology_as_processes(own_cluster):
    """What docker-compose.yml runs (etcd, master, three nodes, a bench client found through etcd; TLS and
    the cluster secret on every plane)."""
    cluster = own_cluster(nodes=3, dram_per_node="96MiB", tls=True)
    from kvpool import Client

    with Client(etcd=cluster.etcd_endpoint) as client:
        client.batch_put([f"spread/{i}" for i in range(30)], [os.urandom(1 << 20)] * 30)
        def holding():  # nodes report what they hold every --report-interval
            per_node = [sum(t.objects for t in n.tiers) for n in cluster.master_stats().nodes]
            return len(per_node) == 3 and min(per_node) > 0 and per_node

        wait_until(holding, timeout=10, what="every node to hold some objects")  # placement uses every node
        client.remove_prefix("spread/")
    result = subprocess.run([*KVPOOL, "bench", "--etcd", cluster.etcd_endpoint, "--sizes", "1MiB",
                             "--batch", "12", "--seconds", "0.3"], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert BASE_OPS <= {r["op"] for r in report["results"]}


@pytest.mark.parametrize("component", ["master", "storenode"])
def test_component_commands_have_help(component):
    result = subprocess.run([*KVPOOL, component, "--help"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and "--etcd" in result.stdout
