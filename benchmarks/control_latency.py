"""Latency of the control plane as a client sees it: a fresh-key put and a batch_exists.

Starts its own cluster (one master, one storage node, TCP only) unless --master is
given, and measures in the same run a raw loopback socket round trip between two
processes (64 bytes each way), which is the floor any master round trip sits on.

    .venv/bin/python benchmarks/control_latency.py [--samples 2000] [--master HOST:PORT]

Prints one JSON object: p50/p99 in microseconds for each row.
"""

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import time

os.environ.setdefault("KVPOOL_TRANSPORTS", "tcp")

from kvpool import Client  # noqa: E402
from kvpool.launch.local_cluster import LocalCluster  # noqa: E402

_MESSAGE = 64


def _echo(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray(_MESSAGE)
        while True:
            got = sock.recv_into(buf)
            if not got:
                return
            sock.sendall(buf[:got])


def socket_round_trip(samples: int) -> dict:
    """64 bytes to a process that echoes them, and back: the round trip under every RPC."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        peer = multiprocessing.get_context("spawn").Process(target=_echo, args=(listener.getsockname()[1],),
                                                            daemon=True)
        peer.start()
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    message, buf = os.urandom(_MESSAGE), bytearray(_MESSAGE)
    times = []
    with conn:
        for _ in range(samples):
            started = time.perf_counter()
            conn.sendall(message)
            got = 0
            while got < _MESSAGE:
                got += conn.recv_into(memoryview(buf)[got:])
            times.append(time.perf_counter() - started)
    peer.join(5)
    return summary(times)


def summary(times: list[float]) -> dict:
    times = sorted(t * 1e6 for t in times)
    return {"p50_us": round(statistics.median(times), 1), "p99_us": round(times[int(len(times) * 0.99) - 1], 1),
            "samples": len(times)}


def timed(samples: int, op) -> dict:
    times = []
    for i in range(samples):
        started = time.perf_counter()
        op(i)
        times.append(time.perf_counter() - started)
    return summary(times)


def measure(address: str, samples: int) -> dict:
    value = os.urandom(64 * 1024)
    run = f"bench/control/{os.getpid()}-{time.monotonic_ns()}"
    with Client(address) as client:
        for i in range(50):  # warm the connections (and the master link)
            client.put(f"{run}/warm/{i}", value)
        put = timed(samples, lambda i: client.put(f"{run}/fresh/{i}", value))
        keys = [f"{run}/fresh/{i}" for i in range(32)]
        batch_exists = timed(samples, lambda i: client.batch_exists(keys))
        exists = timed(samples, lambda i: client.exists(keys[i % 32]))
        client.remove_prefix(f"{run}/")
    return {"put_64KiB_fresh": put, "batch_exists_32": batch_exists, "exists": exists}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--master", default=None, help="a running master (default: start a cluster)")
    args = parser.parse_args()
    report = {"socket_round_trip_64B": socket_round_trip(args.samples)}
    if args.master:
        report.update(measure(args.master, args.samples))
    else:
        with LocalCluster(nodes=1, dram_per_node="512MiB") as cluster:
            report.update(measure(cluster.master_address, args.samples))
    report["socket_round_trip_64B_after"] = socket_round_trip(args.samples)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
