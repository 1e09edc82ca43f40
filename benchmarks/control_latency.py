"""Latency of the control plane as a client sees it: a fresh-key put and a batch_exists.

Starts its own cluster (one master, one storage node, TCP only) unless --master is
given, and measures in the same run a raw loopback socket round trip between two
processes (64 bytes each way), which is the floor any master round trip sits on.
Against its own cluster it also measures the master's side of a lookup: a
BatchExists(32) frame sent by hand on a plain socket (no client machinery), the
same after a posted BatchPutEnd of 22 keys (as every lookup of the trace replay
follows one), and the master's CPU per call (utime+stime from /proc/PID/stat).
`--in-process` adds the control port's own handling of a BatchExists(32) frame, fed
to it in this process with no socket (best of 5 × 20,000): the figure least moved
by a busy machine.

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
from kvpool.proto import kvpool_pb2 as pb  # noqa: E402
from kvpool.protocol import control, wire  # noqa: E402
from kvpool.protocol.cluster_layout import parse_hostport  # noqa: E402
from kvpool.security.auth import client_credential, handshake_blocking  # noqa: E402

_POSTED_KEYS = 22  # keys a trace replay request commits before its next lookup
_CLOCK_TICK = os.sysconf("SC_CLK_TCK")

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


def cpu_seconds(pid: int) -> float:
    """utime + stime of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICK


class HandSent:
    """Control frames sent and read on a plain socket: the master's side of a call, without the client's."""

    def __init__(self, control_address: str):
        self.sock = socket.create_connection(parse_hostport(control_address))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        handshake_blocking(self.sock, client_credential(), f"master control port {control_address}")
        self.req_id = 0
        self.buf = bytearray()

    def send(self, method: str, request) -> None:
        self.req_id += 1
        self.sock.sendall(control.pack_call(control.OP_BY_RPC[method], self.req_id, request.SerializeToString()))

    def replies(self, count: int) -> list:
        """The next `count` replies, as (status, body)."""
        out, header = [], wire.REPLY.size
        while len(out) < count:
            while len(self.buf) >= header:
                length = wire.REPLY.unpack_from(self.buf)[6]
                if len(self.buf) < header + length:
                    break
                out.append((wire.REPLY.unpack_from(self.buf)[4], bytes(self.buf[header:header + length])))
                del self.buf[:header + length]
            if len(out) < count:
                got = self.sock.recv(65536)
                if not got:
                    raise EOFError("closed by the master")
                self.buf += got
        return out

    def call(self, method: str, request):
        self.send(method, request)
        ((status, body),) = self.replies(1)
        if status:
            raise RuntimeError(f"{method}: status {status}: {body[:200]!r}")
        return control.MESSAGES[method][1].FromString(body)

    def close(self) -> None:
        self.sock.close()


def master_side(control_address: str, pid: int | None, run: str, samples: int) -> dict:
    """Hand-sent BatchExists(32) round trips, alone and each after a posted BatchPutEnd, with the
    master's CPU per call when its pid is known."""
    link = HandSent(control_address)
    lookup = pb.BatchExistsRequest(keys=[f"{run}/fresh/{i}" for i in range(32)])
    report = {}

    def lookups(i):
        link.send("BatchExists", lookup)
        link.replies(1)

    for _ in range(200):
        lookups(0)
    cpu = cpu_seconds(pid) if pid else 0.0
    report["hand_sent_batch_exists_32"] = timed(samples, lookups)
    if pid:
        report["hand_sent_batch_exists_32"]["master_cpu_us"] = round((cpu_seconds(pid) - cpu) / samples * 1e6, 1)

    # Each request's keys started first (not timed), then its BatchPutEnd posted and a lookup sent.
    starts = []
    for i in range(samples):
        keys = [f"{run}/posted/{i}/{k}" for k in range(_POSTED_KEYS)]
        started = link.call("BatchPutStart", pb.BatchPutStartRequest(
            keys=keys, sizes=[4096] * len(keys), checksums=[0] * len(keys),
            common=pb.PutStartRequest(replicas=1)))
        starts.append(pb.BatchPutEndRequest(keys=keys, generations=list(started.generations)))
    times, cpu_spent = [], 0.0
    for end in starts:
        cpu = cpu_seconds(pid) if pid else 0.0
        begun = time.perf_counter()
        link.send("BatchPutEnd", end)
        link.send("BatchExists", lookup)
        (ended, _), (found, _) = link.replies(2)
        times.append(time.perf_counter() - begun)
        if ended or found:
            raise RuntimeError(f"BatchPutEnd/BatchExists answered {ended}/{found}")
        if pid:
            cpu_spent += cpu_seconds(pid) - cpu
    report["hand_sent_batch_exists_32_after_posted_put_end_22"] = summary(times)
    if pid:
        report["hand_sent_batch_exists_32_after_posted_put_end_22"]["master_cpu_us"] = round(
            cpu_spent / samples * 1e6, 1)
    link.close()
    return report


def measure(address: str, samples: int, control_address: str | None = None, pid: int | None = None) -> dict:
    value = os.urandom(64 * 1024)
    run = f"bench/control/{os.getpid()}-{time.monotonic_ns()}"
    with Client(address) as client:
        for i in range(50):  # warm the connections (and the master link)
            client.put(f"{run}/warm/{i}", value)
        put = timed(samples, lambda i: client.put(f"{run}/fresh/{i}", value))
        keys = [f"{run}/fresh/{i}" for i in range(32)]
        batch_exists = timed(samples, lambda i: client.batch_exists(keys))
        cpu = cpu_seconds(pid) if pid else 0.0
        batch_exists = timed(samples, lambda i: client.batch_exists(keys))
        if pid:
            batch_exists["master_cpu_us"] = round((cpu_seconds(pid) - cpu) / samples * 1e6, 1)
        exists = timed(samples, lambda i: client.exists(keys[i % 32]))
        report = {"put_64KiB_fresh": put, "batch_exists_32": batch_exists, "exists": exists}
        if control_address:
            report.update(master_side(control_address, pid, run, samples))
        client.remove_prefix(f"{run}/")
    return report


def handling_in_process() -> dict:
    """The master's control port handling BatchExists(32) frames, fed to data_received with no socket
    (the replies go nowhere): the Python a lookup costs the master, apart from its system calls."""
    import asyncio

    from kvpool.master.serving.control_port import ControlPort, _Connection
    from kvpool.master.serving.metrics import MasterMetrics
    from kvpool.master.nodes.node_io import NodeIO
    from kvpool.master.table.objects import ObjectTable
    from kvpool.master.serving.service import MasterService

    class Nowhere:
        def write(self, data):
            pass

    async def run() -> float:
        table = ObjectTable()
        connection = _Connection(ControlPort(MasterService(table, NodeIO(), MasterMetrics(table), "m", "-")))
        connection.transport, connection.handshake = Nowhere(), None
        request = pb.BatchExistsRequest(keys=[f"bench/model/{i:016x}" for i in range(32)])
        frame = control.pack_call(control.OP_BY_RPC["BatchExists"], 1, request.SerializeToString())
        best, calls = float("inf"), 20000
        for round_ in range(6):
            started = time.perf_counter()
            for _ in range(calls):
                connection.data_received(frame)
            if round_:  # the first warms up
                best = min(best, (time.perf_counter() - started) / calls)
        return best

    return {"us_per_frame": round(asyncio.run(run()) * 1e6, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--master", default=None, help="a running master (default: start a cluster)")
    parser.add_argument("--in-process", action="store_true", help="also the master's handling of a frame, here")
    args = parser.parse_args()
    report = {"socket_round_trip_64B": socket_round_trip(args.samples)}
    if args.in_process:
        report["master_handling_batch_exists_32_in_process"] = handling_in_process()
    if args.master:
        report.update(measure(args.master, args.samples))
    else:
        with LocalCluster(nodes=1, dram_per_node="512MiB") as cluster:
            report.update(measure(cluster.master_address, args.samples, cluster.master.info["control"],
                                  cluster.master.proc.pid))
    report["socket_round_trip_64B_after"] = socket_round_trip(args.samples)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
