"""`kvpool bench`: throughput and latency of a running cluster, against baselines measured in the same run.

Machines here are shared and noisy, so every throughput is also given as a ratio
of a raw loopback socket stream between two processes, measured just before.
The last line printed is one JSON object.

With compress=True the put and get operations store lz4-compressed values made
of repeated token-like phrases (as compressible as real prompt prefixes are
repetitive), throughput counts the bytes callers see, and the report adds the
compression ratio and the time compressing and decompressing one value takes.
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


def token_like_value(size: int, seed: int = 0) -> bytes:
    """Compressible bytes: a stream of phrases (runs of 32-bit token ids) drawn from a small
    pool, each followed by a random 32-bit position, so repeats are near but never exact runs."""
    rng = np.random.default_rng(seed)
    phrases = rng.integers(0, 50_000, (64, 24), dtype=np.uint32)  # 64 phrases of 24 tokens
    count = size // (25 * 4) + 1
    stream = np.empty((count, 25), dtype=np.uint32)
    stream[:, :24] = phrases[rng.integers(0, len(phrases), count)]
    stream[:, 24] = rng.integers(0, 1 << 32, count, dtype=np.uint32)
    return stream.tobytes()[:size]


def compression_cost(value: bytes, rounds: int = 5) -> dict:
    """Ratio and best-of-`rounds` time of compressing and decompressing `value` as put/get do."""
    from .client import compression

    view = memoryview(value)
    best_c = best_d = float("inf")
    stored = b""
    for _ in range(rounds):
        started = time.perf_counter()
        stored = compression.encode(view, True, None)
        best_c = min(best_c, time.perf_counter() - started)
        started = time.perf_counter()
        compression.decode(stored, len(value), "bench")
        best_d = min(best_d, time.perf_counter() - started)
    size = len(value)
    return {"size": size, "stored": len(stored), "ratio": round(size / len(stored), 2),
            "compress_us": round(best_c * 1e6, 1), "decompress_us": round(best_d * 1e6, 1),
            "compress_MBps": round(size / best_c / 1e6, 1), "decompress_MBps": round(size / best_d / 1e6, 1)}


def _size_ops(client, size: int, batch: int, seconds: float, compress: bool = False):
    """Yield (op name, bytes/s) for every operation at one value size."""
    count = max(1, min(batch, _BUDGET // max(size, 1)))
    keys = [f"bench/{size}/{i}" for i in range(count)]
    value = token_like_value(size) if compress else os.urandom(size)
    options = {"compress": True} if compress else {}
    out = np.empty(size, dtype=np.uint8)
    big = np.empty(size * count, dtype=np.uint8)
    slots = [big[i * size:(i + 1) * size] for i in range(count)]
    turn = iter(range(1 << 62))

    def key():
        return keys[next(turn) % count]

    def put():
        client.put(key(), value, overwrite=True, **options)
        return size

    def get():
        return len(client.get(key()))

    def get_into():
        return client.get_into(key(), out)

    def batch_put():
        client.batch_put(keys, [value] * count, overwrite=True, **options)
        return size * count

    def batch_get_into():
        return sum(client.batch_get_into(keys, slots))

    client.batch_put(keys, [value] * count, overwrite=True, **options)
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


def run_bench(client, sizes: list[int], batch: int = 64, seconds: float = 1.5, compress: bool = False) -> dict:
    progress = _Progress(total=3 + 5 * len(sizes) + 1)
    # The socket baseline is taken before and after the cluster runs and averaged, so a
    # passing load on the machine moves baseline and results alike.
    socket_before = socket_stream_baseline()
    progress.step("socket baseline")
    memcpy_bps = memcpy_baseline()
    progress.step("memcpy baseline")
    measured = []
    for size in sizes:
        for name, bps in _size_ops(client, size, batch, seconds, compress):
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
    if compress:
        costs = [compression_cost(token_like_value(size)) for size in sizes]
        report["compression"] = {"codec": "lz4.block", "data": "token-like phrases", "sizes": costs}
        for cost in costs:
            print(f"compress {format_size(cost['size']):>7}: ratio {cost['ratio']:.2f}, "
                  f"compress {cost['compress_us']:.0f} us, decompress {cost['decompress_us']:.0f} us",
                  file=sys.stderr)
    for row in results:
        print(f"{row['op']:<15} {format_size(row['size']):>7} {row['MBps']:>9.1f} MB/s  "
              f"{row['ratio_to_socket']:.2f}x socket", file=sys.stderr)
    print(json.dumps(report), flush=True)
    return report
