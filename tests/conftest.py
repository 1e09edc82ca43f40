"""Fixtures that start real processes on 127.0.0.1 ports they pick."""

import pytest

from kvpool.etcd_server import EtcdServer


@pytest.fixture
def etcd(tmp_path):
    """A real etcd; yields its client endpoint HOST:PORT."""
    server = EtcdServer(tmp_path / "etcd-data", log_path=tmp_path / "etcd.log").start()
    try:
        yield server.endpoint
    finally:
        server.stop()
