"""Disks that fail, on real file systems: a FUSE file system of the tests' own (faulty_fs.py) that returns errors,
slows down and hangs on command, and small tmpfs mounts that fill. A node whose SSD or shared tier fails keeps
serving what its DRAM holds, places nothing on the failing tier, says so (Stats, kvpool status, /readyz, the
kvpool_node_tier_failing metric, one log line) and takes the tier back once it answers; no call waits past its
deadline and no wrong byte is served."""

import hashlib
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvpool import Client
from kvpool.errors import KvpoolError
from kvpool.launch.local_cluster import LocalCluster
from kvpool.net.netutil import wait_until
from kvpool.proto import kvpool_pb2 as pb

from faulty_fs import FaultyFs, unavailable

SIZE = 256 << 10
DEADLINE = 3.0  # the clients' timeout
LATE = DEADLINE + 1.5  # a call that takes longer waited past its deadline

needs_fuse = pytest.mark.skipif(unavailable() is not None, reason=f"no FUSE here: {unavailable()}")


def value_of(key: str) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (SIZE // 64))[:SIZE]


def timed(call):
    """(result or the KvpoolError raised, seconds taken)."""
    began = time.monotonic()
    try:
        result = call()
    except KvpoolError as exc:
        result = exc
    return result, time.monotonic() - began


def served_right(client, keys) -> list:
    """Each key's outcome: True (its bytes, right), or its typed error; a wrong byte or a late answer fails."""
    outcomes = []
    for key in keys:
        value, took = timed(lambda: client.get(key))
        assert took < LATE, f"get({key!r}) took {took:.1f}s"
        assert isinstance(value, KvpoolError) or value == value_of(key), f"wrong bytes for {key!r}"
        outcomes.append(True if not isinstance(value, KvpoolError) else value)
    return outcomes


def put_all(client, keys, **options) -> None:
    for key in keys:
        result, took = timed(lambda: client.put(key, value_of(key), **options))
        assert took < LATE and not isinstance(result, KvpoolError), (key, result, took)


def tier_of(cluster, tier: int):
    return next(t for t in cluster.master_stats().nodes[0].tiers if t.tier == tier)


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read().decode()


def readyz(cluster, node: str = "node-0") -> str:
    return scrape(cluster.metrics_urls[node].replace("/metrics", "/readyz"))


def failing_metric(cluster, tier: str, node: str = "node-0") -> float:
    text = scrape(cluster.metrics_urls[node])
    line = next(line for line in text.splitlines() if line.startswith(f'kvpool_node_tier_failing{{tier="{tier}"}}'))
    return float(line.split()[-1])


@pytest.fixture
def faulty(tmp_path):
    # Mounted outside tmp_path: what reads a failed test's directory (its logs) must not meet the mount.
    mountpoint = Path(tempfile.mkdtemp(prefix="kvpool-faulty-"))
    try:
        with FaultyFs(tmp_path / "backing", mountpoint) as fs:
            yield fs
    finally:
        mountpoint.rmdir()


@contextmanager
def tmpfs(path, size: str):
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True, timeout=30)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], timeout=30)


@needs_fuse
def test_an_ssd_that_returns_errors_is_skipped_while_dram_serves_and_taken_back_when_it_heals(faulty, tmp_path):
    with LocalCluster(nodes=1, dram_per_node="16MiB", ssd_per_node="16MiB", metrics=True,
                      node_args=["--ssd-dir", str(faulty.mountpoint / "ssd")], data_dir=tmp_path / "c") as cluster, \
            Client(cluster.master_address, timeout=DEADLINE) as client:
        on_ssd, in_dram = [f"ssd/{i}" for i in range(8)], [f"dram/{i}" for i in range(8)]
        put_all(client, on_ssd, tier="ssd")
        put_all(client, in_dram)
        assert tier_of(cluster, pb.SSD).objects == 8 and tier_of(cluster, pb.SSD).fault == ""

        faulty.set("eio")
        # The first write that meets the disk finds it failing (that put fails, typed, in time); from then on
        # puts asking for SSD land in DRAM.
        attempts = [timed(lambda i=i: client.put(f"after/{i}", value_of(f"after/{i}"), tier="ssd")) for i in range(6)]
        assert all(took < LATE for _, took in attempts)
        assert sum(isinstance(result, KvpoolError) for result, _ in attempts) <= 1, attempts
        wait_until(lambda: "EIO" in tier_of(cluster, pb.SSD).fault, 20, what="Stats to name the SSD's fault")
        # nothing new placed there (the master counts a put by the tier it asked until the node's REPORT says)
        wait_until(lambda: tier_of(cluster, pb.SSD).objects == 8, 10, what="the SSD to hold only the first 8")
        assert served_right(client, in_dram) == [True] * 8
        served_right(client, on_ssd)  # each right, or refused typed and in time
        assert "ssd tier fails: EIO" in readyz(cluster)
        assert failing_metric(cluster, "ssd") == 1
        log = cluster.nodes[0].log_path.read_text()
        assert log.count("fails (EIO") == 1, log  # one line, however many calls met it

        faulty.set("ok")
        wait_until(lambda: tier_of(cluster, pb.SSD).fault == "", 20, what="the SSD taken back")
        put_all(client, [f"healed/{i}" for i in range(4)], tier="ssd")
        wait_until(lambda: tier_of(cluster, pb.SSD).objects == 12, 10, what="new puts on the SSD again")
        assert served_right(client, on_ssd + [f"healed/{i}" for i in range(4)]) == [True] * 12
        assert failing_metric(cluster, "ssd") == 0 and "answers again" in cluster.nodes[0].log_path.read_text()


def shared_cluster(tmp_path, shared_dir, **options):
    return LocalCluster(nodes=2, dram_per_node="16MiB", shared_dir=shared_dir, metrics=True,
                        node_args=["--shared-timeout", "1"], data_dir=tmp_path / "c", **options)


def shared_objects(cluster) -> int:
    stats = cluster.master_stats()
    return stats.shared.objects if stats.HasField("shared") else 0


def shared_faults(cluster) -> list[str]:
    return [n.shared_fault for n in cluster.master_stats().nodes]


@needs_fuse
def test_a_shared_mount_that_hangs_holds_no_call_past_its_deadline_and_is_taken_back(faulty, tmp_path):
    with shared_cluster(tmp_path, faulty.mountpoint) as cluster, \
            Client(cluster.master_address, timeout=DEADLINE) as client, \
            Client(cluster.master_address, timeout=DEADLINE, shared_dir=str(faulty.mountpoint)) as direct:
        shared, local = [f"shared/{i}" for i in range(6)], [f"local/{i}" for i in range(6)]
        put_all(client, shared, tier="shared")
        wait_until(lambda: shared_objects(cluster) == 6, 20, what="the puts moved to the shared tier")
        put_all(client, local)

        faulty.set("hang")  # an NFS server that stopped answering: every call on the mount blocks
        outcomes = served_right(client, shared)  # refused (typed) within the deadline, never hung
        assert not any(outcome is True for outcome in outcomes), outcomes
        # A client that mounts the tier itself waits on its own read no longer than its deadline either.
        assert not any(outcome is True for outcome in served_right(direct, shared[:2]))
        wait_until(lambda: all("did not answer" in f for f in shared_faults(cluster)), 20,
                   what="both nodes to skip the hung tier")
        # The nodes' loops never waited on the mount: DRAM keeps serving, new puts land, reads are quick.
        fresh = [f"fresh/{i}" for i in range(6)]
        put_all(client, fresh)
        began = time.monotonic()
        assert served_right(client, local + fresh) == [True] * 12
        assert time.monotonic() - began < 5
        outcomes = served_right(client, shared)  # refused at once now: the tier is skipped
        assert not any(outcome is True for outcome in outcomes)
        assert "shared tier fails: a call did not answer" in readyz(cluster)
        assert failing_metric(cluster, "shared") == 1

        faulty.set("ok")
        wait_until(lambda: shared_faults(cluster) == ["", ""], 20, what="the shared tier taken back")
        assert served_right(client, shared + local + fresh) == [True] * 18
        wait_until(lambda: direct._core.shared_gate.fault is None, 20, what="the client's own reads taken back")
        before = direct._core.shared_bytes
        assert served_right(direct, shared) == [True] * 6
        assert direct._core.shared_bytes > before  # read from the files again, no node between


@needs_fuse
def test_a_shared_mount_that_errs_or_slows_keeps_what_waits_and_serves_within_deadlines(faulty, tmp_path):
    with shared_cluster(tmp_path, faulty.mountpoint) as cluster, \
            Client(cluster.master_address, timeout=DEADLINE) as client:
        first = [f"first/{i}" for i in range(4)]
        put_all(client, first, tier="shared")
        wait_until(lambda: shared_objects(cluster) == 4, 20, what="the first puts moved to the shared tier")

        faulty.set("slow", 0.05)  # slow, not failing: each read answers late (its calls wait), within the timeout
        assert served_right(client, first) == [True] * 4
        assert shared_faults(cluster) == ["", ""]

        faulty.set("eio")
        outcomes = served_right(client, first)
        assert not any(outcome is True for outcome in outcomes)  # refused typed, fast
        wait_until(lambda: any("EIO" in f for f in shared_faults(cluster)), 20, what="a node to name EIO")
        waiting = [f"waiting/{i}" for i in range(4)]
        put_all(client, waiting, tier="shared")  # kept in DRAM while the tier fails, served from there
        assert served_right(client, waiting) == [True] * 4

        faulty.set("ok")
        wait_until(lambda: shared_faults(cluster) == ["", ""], 20, what="the shared tier taken back")
        wait_until(lambda: shared_objects(cluster) == 8, 20, what="what waited moved on to the shared tier")
        assert served_right(client, first + waiting) == [True] * 8


def test_a_shared_tmpfs_that_fills_is_skipped_and_taken_back_when_space_is_freed(tmp_path):
    if unavailable() == "mounting needs root":
        pytest.skip("mounting a tmpfs needs root")
    with tmpfs(tmp_path / "small", "12m") as mount:
        ballast = mount / "ballast"  # another user of the disk, filling it
        with LocalCluster(nodes=1, dram_per_node="8MiB", shared_dir=mount, shared_capacity="64MiB", metrics=True,
                          node_args=["--high-watermark", "0.7", "--low-watermark", "0.5"],
                          data_dir=tmp_path / "c") as cluster, \
                Client(cluster.master_address, timeout=DEADLINE) as client:
            ballast.write_bytes(bytes(10 << 20))
            keys = [f"full/{i:03d}" for i in range(40)]  # 10 MiB through 8 MiB of DRAM into 2 MiB of room
            for key in keys:
                put_all(client, [key])
            wait_until(lambda: "ENOSPC" in shared_faults(cluster)[0], 20, what="the node to name ENOSPC")
            assert failing_metric(cluster, "shared") == 1
            outcomes = served_right(client, keys)  # what was evicted for want of room is NOT_FOUND, never wrong
            assert sum(outcome is True for outcome in outcomes) >= 10

            before = shared_objects(cluster)
            ballast.unlink()
            wait_until(lambda: shared_faults(cluster) == [""], 20, what="the shared tier taken back")
            more = [f"room/{i:03d}" for i in range(24)]
            for key in more:
                put_all(client, [key])
            wait_until(lambda: shared_objects(cluster) > before, 20, what="victims moving to the tier again")
            assert served_right(client, more[-8:]) == [True] * 8


def test_an_ssd_segment_larger_than_its_disk_stops_the_node_at_start_with_one_line(tmp_path):
    if unavailable() == "mounting needs root":
        pytest.skip("mounting a tmpfs needs root")
    with tmpfs(tmp_path / "small", "4m") as mount:
        result = subprocess.run(
            [sys.executable, "-m", "kvpool.storenode", "--etcd", "127.0.0.1:1", "--dram", "8MiB", "--ssd", "16MiB",
             "--ssd-dir", str(mount), "--port", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if "does not fit" in line]
    assert len(lines) == 1 and "give --ssd a smaller size" in lines[0], result.stderr
