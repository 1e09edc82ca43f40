"""`kvpool bench`: throughput and latency of a running cluster, against baselines measured in the same run.

Machines here are shared and noisy, so every throughput is also given as a ratio
of a raw loopback socket stream between two processes, measured just before.
The last line printed is one JSON object.
"""

import json
import multiprocessing
import os
import socket
import statistics
import sys
import time

import numpy as np

from .units import format_size

_BUDGET = 256 * 1024 * 1024  # bytes of live objects per size, so any cluster of a few hundred MiB can run it
_STREAM_CHUNK = 4 * 1024 * 1024


def _stream_source(port: int, total: int) -> None:
    payload = memoryview(bytearray(os.urandom(_STREAM_CHUNK)))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sent = 0
        while sent < total:
            sock.sendall(payload)
            sent += len(payload)


def socket_stream_baseline(total: int = 1 << 30) -> float:
    """Bytes/s of one Python loopback TCP stream from another process (sendall -> recv_into)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        source = multiprocessing.get_context("spawn").Process(
            target=_stream_source, args=(listener.getsockname()[1], total), daemon=True)
        source.start()
        conn, _ = listener.accept()
    buf = memoryview(bytearray(_STREAM_CHUNK))
    received = 0
    with conn:
        started = time.perf_counter()
        while received < total:
            n = conn.recv_into(buf)
            if not n:
                break
            received += n
        elapsed = time.perf_counter() - started
    source.join(10)
    return received / elapsed


def memcpy_baseline(size: int = 256 * 1024 * 1024, rounds: int = 4) -> float:
    src = np.frombuffer(os.urandom(size), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    started = time.perf_counter()
    for _ in range(rounds):
        np.copyto(dst, src)
    return size * rounds / (time.perf_counter() - started)


class _Progress:
    """A one-line progress bar on stderr when it is a terminal; silent otherwise."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self.enabled = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label:<28}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _timed(seconds: float, op) -> tuple[int, float]:
    """Run `op` (returns bytes moved) repeatedly for about `seconds`; (bytes, elapsed)."""
    moved, started = 0, time.perf_counter()
    while True:
        moved += op()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return moved, elapsed


def _size_ops(client, size: int, batch: int, seconds: float):
    """Yield (op name, bytes/s) for every operation at one value size."""
    count = max(1, min(batch, _BUDGET // max(size, 1)))
    keys = [f"bench/{size}/{i}" for i in range(count)]
    value = os.urandom(size)
    out = np.empty(size, dtype=np.uint8)
    big = np.empty(size * count, dtype=np.uint8)
    slots = [big[i * size:(i + 1) * size] for i in range(count)]
    turn = iter(range(1 << 62))

    def key():
        return keys[next(turn) % count]

    def put():
        client.put(key(), value, overwrite=True)
        return size

    def get():
        return len(client.get(key()))

    def get_into():
        return client.get_into(key(), out)

    def batch_put():
        client.batch_put(keys, [value] * count, overwrite=True)
        return size * count

    def batch_get_into():
        return sum(client.batch_get_into(keys, slots))

    client.batch_put(keys, [value] * count, overwrite=True)
    for name, op in (("put", put), ("get", get), ("get_into", get_into), ("batch_put", batch_put),
                     ("batch_get_into", batch_get_into)):
        moved, elapsed = _timed(seconds, op)
        yield name, moved / elapsed
    client.remove_prefix(f"bench/{size}/")


def get_latency(client, size: int = 64 * 1024, samples: int = 2000) -> dict:
    """Per-call latency of get with a warm placement cache, in microseconds."""
    keys = [f"bench/latency/{i}" for i in range(64)]
    client.batch_put(keys, [os.urandom(size)] * len(keys), overwrite=True)
    for k in keys:
        client.get(k)  # warm the placement cache and the connections
    times = []
    for i in range(samples):
        started = time.perf_counter()
        client.get(keys[i % len(keys)])
        times.append((time.perf_counter() - started) * 1e6)
    client.remove_prefix("bench/latency/")
    times.sort()
    return {"size": size, "samples": samples, "p50_us": round(statistics.median(times), 1),
            "p99_us": round(times[int(len(times) * 0.99) - 1], 1)}


def run_bench(client, sizes: list[int], batch: int = 64, seconds: float = 1.5) -> dict:
    progress = _Progress(total=3 + 5 * len(sizes) + 1)
    # The socket baseline is taken before and after the cluster runs and averaged, so a
    # passing load on the machine moves baseline and results alike.
    socket_before = socket_stream_baseline()
    progress.step("socket baseline")
    memcpy_bps = memcpy_baseline()
    progress.step("memcpy baseline")
    measured = []
    for size in sizes:
        for name, bps in _size_ops(client, size, batch, seconds):
            measured.append((name, size, bps))
            progress.step(f"{name} {format_size(size)}")
    latency = get_latency(client)
    progress.step("64KiB get latency")
    socket_after = socket_stream_baseline()
    progress.step("socket baseline again")
    progress.close()
    socket_bps = (socket_before + socket_after) / 2
    results = [{"op": name, "size": size, "MBps": round(bps / 1e6, 1), "ratio_to_socket": round(bps / socket_bps, 3)}
               for name, size, bps in measured]
    report = {"baseline": {"socket_stream_MBps": round(socket_bps / 1e6, 1),
                           "socket_stream_runs_MBps": [round(socket_before / 1e6, 1), round(socket_after / 1e6, 1)],
                           "memcpy_MBps": round(memcpy_bps / 1e6, 1)},
              "results": results, "get_latency": latency}
    for row in results:
        print(f"{row['op']:<15} {format_size(row['size']):>7} {row['MBps']:>9.1f} MB/s  "
              f"{row['ratio_to_socket']:.2f}x socket", file=sys.stderr)
    print(json.dumps(report), flush=True)
    return report
