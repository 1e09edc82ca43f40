"""Fixtures that start real processes on 127.0.0.1 ports they pick.

Every cluster of the run shares one cluster secret, given to this process (and so to every
component and engine it starts) as $KVPOOL_TOKEN: all of the suite runs authenticated. Tests of
the client role use a cluster's client_token.
"""

import contextlib
import os

import pytest

import tiers
from kvpool.security import auth
from kvpool.cluster.etcd_client import enable_auth
from kvpool.launch.etcd_server import EtcdServer

os.environ.pop("KVPOOL_TOKEN_FILE", None)
os.environ["KVPOOL_TOKEN"] = auth.new_secret()


def pytest_configure(config):
    for name, needs in tiers.NEEDS.items():
        config.addinivalue_line("markers", f"{name}: {needs}")


@pytest.hookimpl(tryfirst=True)  # before -m deselects: the tiers are markers given here
def pytest_collection_modifyitems(items):
    for item in items:
        try:
            place = tiers.place_of(item.path)
        except tiers.NoTier as exc:
            raise pytest.UsageError(str(exc)) from None
        item.add_marker(place)
        if tiers.is_quick(place, {mark.name for mark in item.iter_markers()}):
            item.add_marker("quick")


@contextlib.contextmanager
def _running_etcd(directory):
    server = EtcdServer(directory / "etcd-data", log_path=directory / "etcd.log").start()
    enable_auth(server.endpoint, os.environ["KVPOOL_TOKEN"])
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture
def etcd(tmp_path):
    """A real etcd; yields its client endpoint HOST:PORT."""
    with _running_etcd(tmp_path) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def module_etcd(tmp_path_factory):
    """A real etcd shared by one test module (for tests that register nothing another test would meet)."""
    with _running_etcd(tmp_path_factory.mktemp("etcd")) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """etcd, a master and two storage nodes as real processes, shared by one test module."""
    from kvpool.launch.local_cluster import LocalCluster

    with LocalCluster(nodes=2, dram_per_node="192MiB", data_dir=tmp_path_factory.mktemp("cluster"),
                      lease_ttl=2, put_timeout=3) as running:
        yield running


@pytest.fixture
def own_cluster(tmp_path):
    """A cluster for one test that kills or restarts parts of it; call with the node count."""
    from kvpool.launch.local_cluster import LocalCluster

    started = []

    def start(nodes: int = 2, **options):
        options.setdefault("lease_ttl", 2)
        options.setdefault("put_timeout", 3)
        options.setdefault("dram_per_node", "128MiB")
        running = LocalCluster(nodes=nodes, data_dir=tmp_path / f"cluster{len(started)}", **options).start()
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def client(cluster):
    from kvpool import Client

    with Client(cluster.master_address) as c:
        yield c


LOG_TAIL_LINES = 60


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that ran a cluster under its tmp_path shows the end of each process's log: a
    failure seen only on another machine can then be read from the report alone."""
    report = yield
    if report.failed and call.when == "call":
        tmp_path = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
        if tmp_path is not None:
            for log in sorted(tmp_path.glob("**/logs/*.log")):
                try:
                    lines = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                except OSError:
                    continue
                report.sections.append((f"end of {log.relative_to(tmp_path)}", "\n".join(lines)))
    return report
