"""A rolling upgrade from the previous release (tests/e2e/releases.py PREVIOUS, built from its commit), under
load, in the order docs/upgrades.md gives: storage nodes one at a time, then the standby master, then the leader
(one takeover), then the clients. A client of the previous release puts and reads throughout; at the end a
client of this release reads every put that was acknowledged: 0 lost, 0 wrong bytes, no call past its deadline,
and Stats names this release for the master and every node."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvpool
from kvpool import Client
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until

from releases import PREVIOUS, build, missing_history
from upgrade_load import value_of

HERE = Path(__file__).resolve().parent
NODES = 3


class MixedCluster(LocalCluster):
    """A LocalCluster whose components run the release laid out at `previous` until upgrade() names them."""

    def __init__(self, previous: Path, **options):
        super().__init__(**options)
        self.previous = previous
        self.upgraded: set[str] = set()

    def release_prefix(self, name: str) -> tuple:
        if name in self.upgraded:
            return ()
        # PYTHONSAFEPATH: the working directory (this checkout) must not come before the previous release.
        return ("env", "PYTHONSAFEPATH=1", f"PYTHONPATH={self.previous}")

    def _placement(self, name: str) -> tuple[str, tuple]:
        return self.host, self.release_prefix(name)

    def upgrade_node(self, index: int) -> None:
        self.upgraded.add(f"node-{index}")
        self.restart_node(index)

    def upgrade_master(self, index: int) -> None:
        self.upgraded.add("master" if index == 0 else f"master-{index}")
        self.restart_master(index)


@pytest.fixture(scope="module")
def previous_release(tmp_path_factory):
    why = missing_history(PREVIOUS[1])
    if why:
        pytest.skip(f"the previous release cannot be built: {why}")
    return build(PREVIOUS[1], tmp_path_factory.mktemp(f"kvpool-{PREVIOUS[0]}"))


def acknowledged_so_far(progress: Path) -> int:
    return int(progress.read_text()) if progress.exists() else 0


def test_a_cluster_of_the_previous_release_upgraded_node_by_node_under_load_loses_nothing(previous_release,
                                                                                           tmp_path):
    stop_file, progress = tmp_path / "stop", tmp_path / "progress"
    with MixedCluster(previous_release, nodes=NODES, masters=2, dram_per_node="64MiB", lease_ttl=2,
                      data_dir=tmp_path / "cluster") as cluster:
        stats = cluster.master_stats()
        assert stats.version == "" and {n.version for n in stats.nodes} == {""}  # 0.1.0 names no release
        loader = subprocess.Popen(
            [*cluster.release_prefix("client"), sys.executable, str(HERE / "upgrade_load.py"),
             cluster.etcd_endpoint, cluster.cluster, str(stop_file), str(progress)],
            stdout=subprocess.PIPE, stderr=open(tmp_path / "loader.log", "wb"), text=True)
        try:
            def progressed(by: int, what: str) -> None:
                target = acknowledged_so_far(progress) + by
                wait_until(lambda: acknowledged_so_far(progress) >= target or loader.poll() is not None, 60,
                           what=f"{by} more puts acknowledged {what}")
                assert loader.poll() is None, (tmp_path / "loader.log").read_text()

            def settled(what: str) -> None:
                cluster.wait_for_nodes(NODES, 60)
                wait_until(lambda: cluster.master_stats().under_replicated == 0, 60,
                           what=f"every object back at two copies {what}")

            progressed(50, "before the upgrade")
            for index in range(NODES):
                cluster.upgrade_node(index)
                settled(f"after node-{index}'s upgrade")
                progressed(20, f"after node-{index}'s upgrade")
            cluster.upgrade_master(1)  # the standby first,
            progressed(20, "after the standby master's upgrade")
            cluster.upgrade_master(0)  # then the leader: the upgraded standby takes over
            settled("after the leader's upgrade")
            progressed(20, "after the leader's upgrade")
        finally:
            stop_file.touch()
            out, _ = loader.communicate(timeout=60)
        load = json.loads(out.strip().splitlines()[-1])
        stats = cluster.master_stats()
        assert stats.version == kvpool.__version__
        assert {n.version for n in stats.nodes} == {kvpool.__version__}
        # The clients last: this release's client reads everything the previous one was told was stored.
        keys = load["acknowledged"]
        with Client(cluster.master_addresses) as client:
            values = client.batch_get(keys)
        lost = [key for key, value in zip(keys, values) if value is None]
        wrong = [key for key, value in zip(keys, values) if value is not None and value != value_of(key)]
        assert (lost, wrong) == ([], []), f"{len(lost)} lost, {len(wrong)} wrong of {len(keys)}"
        assert load["wrong"] == [] and load["late"] == [], load
        assert len(keys) >= 190, load["failures"]
        print(f"rolling upgrade: {len(keys)} puts acknowledged, failures {load['failures']}")


def test_masters_of_this_release_take_over_from_nodes_of_the_previous_one(previous_release, tmp_path):
    """A 0.1.0 node does not know INVENTORY_CHANGES: the standby keeps no copy of it (the node answers
    "unknown op"), and its takeover reads that node's whole INVENTORY, as 0.1.0 masters do."""
    cluster = MixedCluster(previous_release, nodes=2, masters=2, dram_per_node="64MiB", lease_ttl=2,
                           master_args=["--election-ttl", "2"], data_dir=tmp_path / "cluster")
    cluster.upgraded |= {"master", "master-1"}
    with cluster:
        keys = [f"mixed/{i:04d}" for i in range(500)]
        with Client(cluster.master_addresses) as client:
            client.batch_put(keys, [value_of(key) for key in keys])
        old, new = cluster.masters
        standby_log = new.log_path
        wait_until(lambda: standby_log.read_text().count("does not know INVENTORY_CHANGES") == 2, 20,
                   what="both 0.1.0 nodes to refuse the standby's INVENTORY_CHANGES")
        old.kill()
        wait_until(lambda: cluster.leader_address() == new.info["address"], 20, what="the standby to lead")
        with Client(new.info["address"], rpc_timeout=30, timeout=30) as client:
            values = client.batch_get(keys)
        assert [key for key, value in zip(keys, values) if value != value_of(key)] == []
        taken_over = standby_log.read_text()
        assert "took over with term" in taken_over and "the standby's copy of its inventory" not in taken_over
