"""Large transfers between hosts: `kvpool bench` over TCP from a client host, against a raw socket stream over
the same bridge.

etcd, a master, one storage node and a client each run on a host of their own (network namespaces joined by a
bridge, MTU 1500: tests/multihost). The raw stream is kvpool bench's own socket baseline, the fastest of its
ways (kvpool/commands/bench.py STREAM_WAYS: sendall of 4 MiB memoryviews into recv_into of a 4 MiB buffer, taking
what is there or waiting for all of it, with autotuned or 16 MiB socket buffers; one sending and one receiving
process) run between the node's host and the client's host, both ways, before and after the bench; `kvpool bench --transport tcp` then runs
in the client's host against the cluster, as an operator would run it there. Each throughput is given as a
ratio of the stream in its direction (reads: node to client; writes: client to node), and of the loopback
stream kvpool bench measures itself in the client's host. The same 4 MiB reads are also made without kvpool
(answer_reads / ask_reads, before and after the bench), so the request/response pattern's own cost shows.

Prints ONE JSON line: both streams, the raw reads, the bench's rows with their ratios, and the aim (get_into 4 MiB >= 0.75
of the stream over the bridge). Needs root (network namespaces).

    python benchmarks/cross_host.py                       # sizes 1MiB,4MiB, 1.5 s per op
    python benchmarks/cross_host.py --sizes 64KiB,1MiB,4MiB,16MiB --seconds 2
"""

import argparse
import itertools
import json
import os
import selectors
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "multihost"))

from netns_hosts import Host, Network, ip, unavailable  # noqa: E402
from spread_cluster import SpreadCluster  # noqa: E402

from kvpool.commands.bench import (STREAM_WAYS, connect_stream, fastest_stream, receive_stream,  # noqa: E402
                                   send_stream, tune_stream)
from kvpool.launch.local_cluster import LocalCluster, stop_process  # noqa: E402
from kvpool.protocol.checksum import Digest  # noqa: E402
from kvpool.protocol.units import parse_size  # noqa: E402

AIM = ("get_into", 4 << 20, 0.75)  # the aim: get_into of 4 MiB, as a ratio of the bridge's stream
WRITES = ("put", "batch_put", "put_fresh", "put_from_fresh", "batch_put_from_fresh")  # client -> node
STREAM_BYTES = 1 << 30  # per stream measurement, as kvpool bench's own baseline
_HEADER = 24  # the request/response pattern's reply header (a few bytes, as kvpool's)
_PIECE = 128 * 1024  # what kvpool's client receives and hashes at a time (kvpool/net/tcp_connection.py)


# -- the stream's two ends, each run as a process of its host


def stream_receive(host: str, total: int, way: str) -> None:
    """Listen on `host`, print {"port"}; receive one stream of `total` bytes moved `way`, print {"bps"}."""
    with socket.socket() as listener:
        tune_stream(listener, way)
        listener.bind((host, 0))
        listener.listen(1)
        print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
        conn, _ = listener.accept()
    print(json.dumps({"bps": receive_stream(conn, total, way)}), flush=True)


def stream_send(host: str, port: int, total: int, way: str) -> None:
    with connect_stream(host, port, way) as sock:
        send_stream(sock, total)


def answer_reads(host: str, size: int) -> None:
    """The request/response pattern without kvpool: listen on `host`, print {"port"}; for each 8-byte request
    send a 24-byte header and `size` bytes from one of 64 places of a buffer (for 4 MiB, 256 MiB: out of cache,
    as the bench's values are) in one blocking sendmsg, until the peer closes."""
    values = memoryview(bytearray(os.urandom(size)) * 64)
    with socket.socket() as listener:
        listener.bind((host, 0))
        listener.listen(1)
        print(json.dumps({"port": listener.getsockname()[1]}), flush=True)
        conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        for turn in itertools.count():
            if len(conn.recv(8)) < 8:
                return
            start = turn % 64 * size
            conn.sendmsg([bytes(_HEADER), values[start:start + size]])


def ask_reads(host: str, port: int, size: int, seconds: float) -> None:
    """The client of answer_reads: requests one value at a time for `seconds`, receiving each as the client
    receives a READ (128 KiB pieces into the destination, each hashed as it lands); prints {"bps"}."""
    out, header = memoryview(bytearray(size)), memoryview(bytearray(_HEADER))
    with socket.create_connection((host, port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        moved, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            sock.sendall(size.to_bytes(8, "little"))
            got = 0
            while got < _HEADER:
                got += sock.recv_into(header[got:])
            digest, got = Digest(), 0
            while got < size:
                more = sock.recv_into(out[got:got + _PIECE])
                if not more:
                    raise EOFError("the server closed")
                digest.update(out[got:got + more])
                got += more
            moved += size
        print(json.dumps({"bps": moved / (time.perf_counter() - started)}), flush=True)


def _line(proc: subprocess.Popen, timeout: float, what: str) -> dict:
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{what}: the process exited with {proc.wait()}")
    return json.loads(line)


def stream(sender: Host, receiver: Host, total: int, way: str, timeout: float = 120.0) -> float:
    """Bytes/s of one raw TCP stream from `sender` to `receiver` over the bridge, moved `way` (STREAM_WAYS)."""
    me = [sys.executable, os.path.abspath(__file__)]
    receiving = subprocess.Popen(receiver.command([*me, "stream-receive", receiver.address, total, way]),
                                 stdout=subprocess.PIPE, text=True, start_new_session=True)
    sending = None
    try:
        port = _line(receiving, timeout, f"port from the stream receiver on {receiver.name}")["port"]
        sending = subprocess.Popen(sender.command([*me, "stream-send", receiver.address, port, total, way]),
                                   start_new_session=True)
        return _line(receiving, timeout, f"stream {sender.name} -> {receiver.name}")["bps"]
    finally:
        for proc in (sending, receiving):
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    stop_process(proc, timeout=5)


def request_response(node: Host, client: Host, size: int, seconds: float, timeout: float = 120.0) -> float:
    """Bytes/s of answer_reads in `node`'s host asked by ask_reads in `client`'s."""
    me = [sys.executable, os.path.abspath(__file__)]
    serving = subprocess.Popen(node.command([*me, "answer-reads", node.address, size]), stdout=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        port = _line(serving, timeout, f"port from the request/response server on {node.name}")["port"]
        done = subprocess.run(client.command([*me, "ask-reads", node.address, port, size, seconds]),
                              capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"ask-reads exited with {done.returncode}: {done.stderr[-500:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])["bps"]
    finally:
        try:
            serving.wait(10)
        except subprocess.TimeoutExpired:
            stop_process(serving, timeout=5)


def streams(node: Host, client: Host, total: int) -> tuple[dict, dict]:
    """The fastest stream each way ({direction: bytes/s}), and every way's figure ({direction: {way: bytes/s}})."""
    fastest, ways = {}, {}
    for direction, (sender, receiver) in (("node_to_client", (node, client)), ("client_to_node", (client, node))):
        fastest[direction], ways[direction] = fastest_stream(lambda way: stream(sender, receiver, total, way))
    return fastest, ways


# -- the bench, from the client's host


def run_bench(cluster, client: Host | None, args, log_path: Path) -> dict:
    """`kvpool bench --transport tcp` run in `client`'s host (None: on this one, over loopback); its report."""
    kvpool = Path(sys.executable).with_name("kvpool")
    argv = [str(kvpool), "bench", "--master", cluster.master_address, "--cluster", cluster.cluster,
            "--transport", "tcp", "--sizes", args.sizes, "--batch", str(args.batch), "--seconds", str(args.seconds)]
    with open(log_path, "wb") as log:
        done = subprocess.run(client.command(argv) if client is not None else argv, stdout=subprocess.PIPE,
                              stderr=log, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"kvpool bench exited with {done.returncode} (log: {log_path})")
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


def report(bench: dict, before: dict, after: dict, mtu: int, raw_reads: list) -> dict:
    """The JSON line: the streams (mean of before and after), each tcp row as a ratio of the stream in its
    direction and of the bench's loopback stream, the request/response pattern without kvpool, and the aim."""
    bridge = {way: (before[way] + after[way]) / 2 for way in before}
    loopback = bench["baseline"]["socket_stream_MBps"] * 1e6
    rows = []
    for row in bench["results"]:
        if row["transport"] != "tcp":
            continue
        way = "client_to_node" if row["op"] in WRITES else "node_to_client"
        bps = row["MBps"] * 1e6
        rows.append({"op": row["op"], "size": row["size"], **({"batch": row["batch"]} if "batch" in row else {}),
                     "MBps": row["MBps"], "ratio_to_bridge_stream": round(bps / bridge[way], 3),
                     "ratio_to_loopback_stream": round(bps / loopback, 3)})
    op, size, aim = AIM
    hit = next((r for r in rows if (r["op"], r["size"]) == (op, size)), None)
    ratio = hit["ratio_to_bridge_stream"] if hit else None
    return {
        "mtu": mtu,
        "bridge_stream_MBps": {way: round(bps / 1e6, 1) for way, bps in bridge.items()},
        "bridge_stream_runs_MBps": {way: [round(before[way] / 1e6, 1), round(after[way] / 1e6, 1)]
                                    for way in before},
        "loopback_stream_MBps": round(loopback / 1e6, 1),
        "bridge_to_loopback": round(bridge["node_to_client"] / loopback, 3),
        "raw_request_response_4MiB": {"MBps": round(sum(raw_reads) / len(raw_reads) / 1e6, 1),
                                      "runs_MBps": [round(bps / 1e6, 1) for bps in raw_reads],
                                      "ratio_to_bridge_stream":
                                          round(sum(raw_reads) / len(raw_reads) / bridge["node_to_client"], 3)},
        "results": rows,
        "targets": {f"tcp {op} 4MiB / bridge stream": {"ratio": ratio, "aim": aim,
                                                        "met": None if ratio is None else ratio >= aim}},
        "get_latency_us": bench["transports"].get("tcp", {}).get("get_latency"),
        "settings": bench["settings"],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1MiB,4MiB", help="value sizes for kvpool bench (default 1MiB,4MiB)")
    p.add_argument("--batch", type=int, default=64, help="keys per batch call (default 64)")
    p.add_argument("--seconds", type=float, default=1.5, help="seconds per op and size (default 1.5)")
    p.add_argument("--stream-bytes", type=parse_size, default=STREAM_BYTES,
                   help="bytes per stream measurement (default 1GiB, as kvpool bench's own)")
    p.add_argument("--dram", default="1GiB", help="DRAM of the storage node (default 1GiB)")
    p.add_argument("--timeout", type=float, default=600.0, help="longest the bench may run (default 600 s)")
    p.add_argument("--keep", default=None, help="keep logs in this directory")
    p.add_argument("--loopback", action="store_true",
                   help="also run the bench against one node on this host, and give each op's ratio to it")
    args = p.parse_args(argv)
    for size in args.sizes.split(","):
        parse_size(size)  # a bad size fails here, not in the namespace
    why = unavailable()
    if why:
        print(f"cross_host.py: {why}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvpool-cross-host-") as tmp:
        base = Path(args.keep or tmp)
        with Network() as network, SpreadCluster(network, nodes=1, dram_per_node=args.dram,
                                                 data_dir=base / "cluster") as cluster:
            client, node = cluster.client_hosts[0], cluster.host_of("node-0")
            mtu = _mtu(node)
            # the stream and the raw reads before and after the bench, averaged (as the bench's own baseline)
            before, ways_before = streams(node, client, args.stream_bytes)
            raw_reads = [request_response(node, client, AIM[1], args.seconds)]
            bench = run_bench(cluster, client, args, base / "bench.log")
            after, ways_after = streams(node, client, args.stream_bytes)
            raw_reads.append(request_response(node, client, AIM[1], args.seconds))
        line = report(bench, before, after, mtu, raw_reads)
        if args.loopback:  # the same bench against one node on this host, right after: each op's loopback rate
            with LocalCluster(nodes=1, dram_per_node=args.dram, data_dir=base / "loopback") as local:
                alone = run_bench(local, None, args, base / "bench-loopback.log")
            rates = {(r["op"], r["size"]): r["MBps"] for r in alone["results"] if r["transport"] == "tcp"}
            for row in line["results"]:
                if rates.get((row["op"], row["size"])):
                    row["loopback_run_MBps"] = rates[(row["op"], row["size"])]
                    row["ratio_to_loopback_run"] = round(row["MBps"] / row["loopback_run_MBps"], 3)
        line["bridge_stream_ways_MBps"] = {
            direction: {way: [round(ways_before[direction][way] / 1e6, 1), round(ways_after[direction][way] / 1e6, 1)]
                        for way in STREAM_WAYS} for direction in ways_before}
        print(json.dumps(line), flush=True)
    return 0


def _mtu(host: Host) -> int:
    shown = ip("-o", "link", "show", "eth0", ns=host.namespace)
    return int(shown.split(" mtu ")[1].split()[0])


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "stream-receive":
        stream_receive(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "stream-send":
        stream_send(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
    elif len(sys.argv) > 1 and sys.argv[1] == "answer-reads":
        answer_reads(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) > 1 and sys.argv[1] == "ask-reads":
        ask_reads(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    else:
        sys.exit(main())
