"""`kvpool bench`: throughput and latency of a running cluster, against baselines measured in the same run.

Machines here are shared and noisy, so every throughput is also given as a ratio
of a raw loopback socket stream between two processes, measured before and
after the runs. The last line printed is one JSON object.

Each run names the data transport its client was restricted to (shm, ucx,
tcp); TRANSPORT_ALL runs every one this client can use against the same
values, one after another, between the same baselines. A run counts only if
the client's bytes_by_transport() shows that its transport, and no other,
carried the value bytes: a transport that could not be used is listed under
"skipped" with the reason, never reported under another name. Rows of TCP and
UCX runs are ratios of the socket stream; shared memory never touches a
socket, so its rows are also given as ratios of memcpy.

With compress=True the put and get operations store lz4-compressed values made
of repeated token-like phrases (as compressible as real prompt prefixes are
repetitive), throughput counts the bytes callers see, and the report adds the
compression ratio and the time compressing and decompressing one value takes.

put and batch_put rows overwrite the same keys; the *_fresh rows and the
latencies of single calls (bench_latency.py) write keys that never existed.
"""

import inspect
import json
import logging
import multiprocessing
import os
import socket
import sys
import time

import numpy as np
from tqdm import tqdm

from ..protocol import transports as transport_names
from .bench_latency import batch_exists_latency, call_targets, fresh_puts, get_latency
from ..errors import KvpoolError
from ..protocol.units import format_size

TRANSPORT_ALL = "all"

_BUDGET = 256 * 1024 * 1024  # bytes of live objects per size, so any cluster of a few hundred MiB can run it
_STREAM_CHUNK = 4 * 1024 * 1024


# The raw stream a link allows: the fastest of these ways to move bytes through one TCP connection in Python, the
# baseline of kvpool bench (over loopback) and of benchmarks/cross_host.py (between hosts) alike. Each is
# (SO_SNDBUF / SO_RCVBUF set before the connection is made, 0: the kernel's autotuning; recv flags).
STREAM_WAYS = {
    "plain": (0, 0),  # autotuned buffers, recv_into of 4 MiB, taking what is there
    "waitall": (0, socket.MSG_WAITALL),  # one recv_into fills the whole 4 MiB
    "large-buffers": (16 << 20, socket.MSG_WAITALL),  # and 16 MiB socket buffers on both ends
}


def tune_stream(sock: socket.socket, way: str) -> None:
    """Give a socket (a listener, or a sender before it connects) the buffers of stream way `way`."""
    buffers = STREAM_WAYS[way][0]
    if buffers:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)


def send_stream(sock: socket.socket, total: int) -> None:
    """The socket stream's sending side: `total` bytes as sendall of one 4 MiB memoryview after another."""
    payload = memoryview(bytearray(os.urandom(_STREAM_CHUNK)))
    sent = 0
    while sent < total:
        sock.sendall(payload)
        sent += len(payload)


def receive_stream(conn: socket.socket, total: int, way: str = "plain") -> float:
    """The socket stream's receiving side: recv_into a preallocated 4 MiB buffer until `total` bytes (or the
    end) came; bytes/s from the first receive on."""
    buf = memoryview(bytearray(_STREAM_CHUNK))
    flags = STREAM_WAYS[way][1]
    received = 0
    with conn:
        started = time.perf_counter()
        while received < total:
            n = conn.recv_into(buf, 0, flags)
            if not n:
                break
            received += n
        elapsed = time.perf_counter() - started
    return received / elapsed


def connect_stream(host: str, port: int, way: str, timeout: float = 30.0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tune_stream(sock, way)
    sock.settimeout(timeout)
    sock.connect((host, port))
    return sock


def _stream_source(port: int, total: int, way: str) -> None:
    with connect_stream("127.0.0.1", port, way) as sock:
        send_stream(sock, total)


def loopback_stream(total: int, way: str) -> float:
    """Bytes/s of one Python loopback TCP stream from another process (sendall -> recv_into), moved `way`."""
    with socket.socket() as listener:
        tune_stream(listener, way)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        source = multiprocessing.get_context("spawn").Process(
            target=_stream_source, args=(listener.getsockname()[1], total, way), daemon=True)
        source.start()
        conn, _ = listener.accept()
    bps = receive_stream(conn, total, way)
    source.join(10)
    return bps


def fastest_stream(measure) -> tuple[float, dict]:
    """(bytes/s of the fastest way, {way: bytes/s}) with measure(way) -> bytes/s of one stream moved that way."""
    figures = {way: measure(way) for way in STREAM_WAYS}
    return max(figures.values()), figures


def socket_stream_baseline(total: int = 1 << 30) -> float:
    """Bytes/s of the fastest loopback stream (STREAM_WAYS), each way moving `total` bytes."""
    return fastest_stream(lambda way: loopback_stream(total, way))[0]


def memcpy_baseline(size: int = 256 * 1024 * 1024, rounds: int = 4) -> float:
    """Bytes/s of numpy copyto between two buffers far larger than the caches."""
    src = np.full(size, 0x5A, dtype=np.uint8)  # a copy's speed does not depend on the bytes
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    started = time.perf_counter()
    for _ in range(rounds):
        np.copyto(dst, src)
    return size * rounds / (time.perf_counter() - started)


class _Progress:
    """A progress bar (tqdm) on stderr when it is a terminal; silent otherwise. `total` may grow as work is
    found."""

    def __init__(self, total: int):
        self._bar = tqdm(total=total, file=sys.stderr, disable=not sys.stderr.isatty(), unit="step",
                         bar_format="{l_bar}{bar:30}| {n_fmt}/{total_fmt} {postfix}")

    @property
    def total(self) -> int:
        return self._bar.total

    @total.setter
    def total(self, value: int) -> None:
        self._bar.total = value
        self._bar.refresh()

    def step(self, label: str) -> None:
        self._bar.set_postfix_str(label, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


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
    from ..client import compression

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


class Workload:
    """Keys and values every run writes and reads: the same bytes whichever transport carries them."""

    LATENCY_SIZE = 64 * 1024

    def __init__(self, sizes: list[int], batch: int, compress: bool = False):
        self.sizes = list(sizes)
        self.batch = batch
        self.compress = compress
        self.values = {size: token_like_value(size) if compress else os.urandom(size) for size in self.sizes}
        self.counts = {size: max(1, min(batch, _BUDGET // max(size, 1))) for size in self.sizes}
        self.latency_value = os.urandom(self.LATENCY_SIZE)

    def keys(self, size: int) -> list[str]:
        return [f"bench/{size}/{i}" for i in range(self.counts[size])]


_OPS = ("put", "get", "get_into", "batch_put", "batch_get_into")
_ZERO_COPY_OPS = ("batch_get_into_offsets", "batch_get_into_parts")
_BATCH_OPS = ("batch_put", "batch_get_into", *_ZERO_COPY_OPS, "batch_put_from_fresh")
_CALL_STEPS = 6  # progress steps of the per-call measurements: get latency, 4 fresh puts, batch_exists
PARTS = 4  # the parts form scatters each value into this many equal pieces (say K and V of two layers)


def zero_copy_forms(client) -> list[str]:
    """Which of the one-buffer-with-offsets and parts forms of batch_get_into this client has."""
    forms = []
    if "offsets" in inspect.signature(client.batch_get_into).parameters:
        forms.append("batch_get_into_offsets")
    if callable(getattr(client, "batch_get_into_parts", None)):
        forms.append("batch_get_into_parts")
    return forms


def _size_ops(client, workload: Workload, size: int, seconds: float):
    """Yield (op name, bytes/s) for every operation at one value size."""
    count = workload.counts[size]
    keys = workload.keys(size)
    value = workload.values[size]
    options = {"compress": True} if workload.compress else {}
    out = np.empty(size, dtype=np.uint8)
    big = np.empty(size * count, dtype=np.uint8)
    out.fill(0)  # fault the pages in now: the first op timed should not pay for a fresh buffer's pages
    big.fill(0)
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

    offsets = [i * size for i in range(count)]

    def batch_get_into_offsets():  # one buffer, each key at its offset: how KV caches are laid out
        return sum(client.batch_get_into(keys, big, offsets=offsets))

    piece = size // PARTS
    parts = [[slot[j * piece:(j + 1) * piece] for j in range(PARTS - 1)] + [slot[(PARTS - 1) * piece:]]
             for slot in slots]

    def batch_get_into_parts():
        return sum(client.batch_get_into_parts(keys, parts))

    ops = {"put": put, "get": get, "get_into": get_into, "batch_put": batch_put, "batch_get_into": batch_get_into,
           "batch_get_into_offsets": batch_get_into_offsets, "batch_get_into_parts": batch_get_into_parts}
    client.batch_put(keys, [value] * count, overwrite=True, **options)
    for name in (*_OPS, *zero_copy_forms(client)):
        moved, elapsed = _timed(seconds, ops[name])
        yield name, moved / elapsed
    client.remove_prefix(f"bench/{size}/")


class Skipped(Exception):
    """A transport's run that cannot be reported: why."""


def _carrier(moved: dict, wanted: str | None) -> str:
    """The name of a run: `wanted` if it, and no other transport, carried the value bytes (else Skipped)."""
    used = {name: n for name, n in moved.items() if n}
    if wanted is None:  # the client's own choice: named after what it used, e.g. "shm+tcp" for a mix
        if not used:
            raise Skipped("no value bytes went over any transport")
        return "+".join(name for name in transport_names.PREFERENCE if name in used)
    others = {name: n for name, n in used.items() if name != wanted}
    if not used.get(wanted) or others:
        raise Skipped(f"asked for {wanted} but value bytes went over {used or 'no transport'}")
    return wanted


def _probe(client, wanted: str | None) -> None:
    """One small put and get, so a transport that cannot carry bytes is found before it is timed."""
    # 64 KiB: big enough to take the transport's own path (shm sends values below 16 KiB on its socket).
    value = os.urandom(64 * 1024)
    client.put("bench/probe", value, overwrite=True)
    if client.get("bench/probe") != value:
        raise Skipped("the probe read back different bytes")
    client.remove("bench/probe")
    _carrier(client.bytes_by_transport(), wanted)


def _measure(connect, wanted: str | None, workload: Workload, seconds: float, progress: "_Progress") -> dict:
    """One transport's run: {"transport", "rows", "get_latency", "bytes_by_transport", "client_warnings"};
    Skipped if its client cannot be made, cannot carry bytes, or lets any other transport carry them."""
    label = wanted or "default"
    with _ClientWarnings() as warnings:
        try:
            run = _measure_with(connect, wanted, label, workload, seconds, progress)
        except Skipped as exc:
            if warnings.lines:  # the selector says why a transport was set aside
                raise Skipped(f"{exc} (client log: {'; '.join(warnings.lines)})") from None
            raise
    run["client_warnings"] = warnings.lines
    return run


def _measure_with(connect, wanted: str | None, label: str, workload: Workload, seconds: float,
                  progress: "_Progress") -> dict:
    try:
        client = connect(wanted)
    except Exception as exc:  # noqa: BLE001 - one transport's broken client must not end the others' runs
        raise Skipped(f"no client: {type(exc).__name__}: {exc}") from None
    with client:
        try:
            _probe(client, wanted)
            progress.step(f"{label} probe")
            progress.total += len(zero_copy_forms(client)) * len(workload.sizes)
            rows = []
            for size in workload.sizes:
                for name, bps in _size_ops(client, workload, size, seconds):
                    rows.append((name, size, bps, workload.counts[size]))
                    progress.step(f"{label} {name} {format_size(size)}")
            latency = get_latency(client, workload.latency_value)
            progress.step(f"{label} 64KiB get latency")
            fresh_rows, calls = fresh_puts(client, seconds, workload.batch,
                                           lambda what: progress.step(f"{label} {what}"))
            rows.extend(fresh_rows)
            calls["batch_exists_latency"] = batch_exists_latency(client)
            progress.step(f"{label} batch_exists latency")
        except KvpoolError as exc:
            try:
                client.remove_prefix("bench/")
            except KvpoolError:
                pass
            raise Skipped(f"{type(exc).__name__}: {exc}") from None
        moved = client.bytes_by_transport()
    return {"transport": _carrier(moved, wanted), "rows": rows, "get_latency": latency, **calls,
            "bytes_by_transport": moved}


class _ClientWarnings(logging.Handler):
    """Collects the client's warnings while a run lasts."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.logger = logging.getLogger("kvpool.client")

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> "_ClientWarnings":
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)


def requested_transports(choice: str | None) -> list[str | None]:
    """The runs --transport asks for: [None] (the client's own choice), one name, or every name."""
    if choice is None:
        return [None]
    if choice == TRANSPORT_ALL:
        return list(transport_names.PREFERENCE)
    if choice not in transport_names.PREFERENCE:
        raise ValueError(f"unknown transport {choice!r}; choose from "
                         f"{', '.join(transport_names.PREFERENCE)} or {TRANSPORT_ALL}")
    return [choice]


# The aims: (transport, op, size, batch or None, baseline, aim ratio).
_RATIO_AIMS = (
    ("tcp", "get_into", 4 << 20, None, "socket", 0.75),
    ("tcp", "batch_get_into", 1 << 20, 64, "socket", 0.75),
    ("shm", "get_into", 4 << 20, None, "memcpy", 0.40),
)
_P50_AIM_US = 300.0


def _targets(results: list[dict], runs: dict, skipped: dict) -> dict:
    """Each aim of the issue: the figure measured, its aim and whether it met it (null: not measured)."""
    targets = {}
    for transport, op, size, batch, baseline, aim in _RATIO_AIMS:
        row = next((r for r in results if (r["transport"], r["op"], r["size"]) == (transport, op, size)), None)
        count = f"{row['batch'] if row else batch} x " if batch else ""
        name = f"{transport} {op} {count}{format_size(size)} / {baseline}"
        if row is None:
            why = skipped.get(transport, "not run" if transport not in runs else f"size {format_size(size)} not run")
            targets[name] = {"ratio": None, "aim": aim, "met": None, "note": why}
        else:
            ratio = row[f"ratio_to_{baseline}"]
            targets[name] = {"ratio": ratio, "aim": aim, "met": ratio >= aim}
    for transport, run in runs.items():
        p50 = run["get_latency"]["p50_us"]
        targets[f"{transport} get 64KiB p50 (warm placement cache)"] = {
            "p50_us": p50, "aim_us": _P50_AIM_US, "met": p50 < _P50_AIM_US}
        targets.update(call_targets(transport, run, [r for r in results if r["transport"] == transport]))
    return targets


def _row(transport: str, name: str, size: int, bps: float, count: int, socket_bps: float, memcpy_bps: float) -> dict:
    row = {"transport": transport, "op": name, "size": size}
    if name in _BATCH_OPS:
        row["batch"] = count
    if name == "batch_get_into_parts":
        row["parts"] = PARTS
    row["MBps"] = round(bps / 1e6, 1)
    row["ratio_to_socket"] = round(bps / socket_bps, 3)
    if transport == transport_names.SHM:
        row["ratio_to_memcpy"] = round(bps / memcpy_bps, 3)
    return row


def run_bench(connect, transports: list[str | None], sizes: list[int], batch: int = 64, seconds: float = 1.5,
              compress: bool = False, security: dict | None = None) -> dict:
    """Benchmark each of `transports` (None: whatever the client picks) on the same workload.

    connect(transport name or None) -> a Client restricted to that transport. Prints the human
    lines on stderr, then the JSON report on stdout."""
    workload = Workload(sizes, batch, compress)
    progress = _Progress(total=4 + len(transports) * (1 + _CALL_STEPS + len(_OPS) * len(sizes)))
    # Baselines are taken before and after the cluster runs and averaged, so a passing
    # load on the machine moves baselines and results alike.
    socket_before = socket_stream_baseline()
    progress.step("socket baseline")
    memcpy_before = memcpy_baseline()
    progress.step("memcpy baseline")
    measured, skipped = [], {}
    for wanted in transports:
        try:
            measured.append(_measure(connect, wanted, workload, seconds, progress))
        except Skipped as exc:
            skipped[wanted or "default"] = str(exc)
    socket_after = socket_stream_baseline()
    progress.step("socket baseline again")
    memcpy_after = memcpy_baseline()
    progress.step("memcpy baseline again")
    progress.close()
    socket_bps = (socket_before + socket_after) / 2
    memcpy_bps = (memcpy_before + memcpy_after) / 2
    results, runs = [], {}
    for run in measured:
        name = run["transport"]
        runs[name] = {"get_latency": run["get_latency"], "put_fresh_latency": run["put_fresh_latency"],
                      "batch_exists_latency": run["batch_exists_latency"],
                      "bytes_by_transport": run["bytes_by_transport"], "client_warnings": run["client_warnings"]}
        results.extend(_row(name, op, size, bps, count, socket_bps, memcpy_bps)
                       for op, size, bps, count in run["rows"])
    report = {"settings": {"transports": [t or "default" for t in transports], "sizes": sizes, "batch": batch,
                           "seconds": seconds, "compress": compress, "security": security or {}},
              "baseline": {"socket_stream_MBps": round(socket_bps / 1e6, 1),
                           "socket_stream_runs_MBps": [round(socket_before / 1e6, 1), round(socket_after / 1e6, 1)],
                           "memcpy_MBps": round(memcpy_bps / 1e6, 1),
                           "memcpy_runs_MBps": [round(memcpy_before / 1e6, 1), round(memcpy_after / 1e6, 1)]},
              "transports": runs, "skipped": skipped, "results": results,
              "targets": _targets(results, runs, skipped)}
    if compress:
        costs = [compression_cost(token_like_value(size)) for size in sizes]
        report["compression"] = {"codec": "lz4.block", "data": "token-like phrases", "sizes": costs}
        for cost in costs:
            print(f"compress {format_size(cost['size']):>7}: ratio {cost['ratio']:.2f}, "
                  f"compress {cost['compress_us']:.0f} us, decompress {cost['decompress_us']:.0f} us",
                  file=sys.stderr)
    _print_human(report)
    print(json.dumps(report), flush=True)
    return report


def _print_human(report: dict) -> None:
    out = sys.stderr
    base = report["baseline"]
    print(f"baselines: socket stream {base['socket_stream_MBps']:.0f} MB/s, memcpy {base['memcpy_MBps']:.0f} MB/s",
          file=out)
    for row in report["results"]:
        op = f"{row['op']} {row['batch']} x" if "batch" in row else row["op"]
        line = f"{row['transport']:<4} {op:<28} {format_size(row['size']):>7} {row['MBps']:>9.1f} MB/s  "
        if "ratio_to_memcpy" in row:
            line += f"{row['ratio_to_memcpy']:.2f}x memcpy  "
        print(line + f"{row['ratio_to_socket']:.2f}x socket", file=out)
    for name, run in report["transports"].items():
        for what, latency in (("get", run["get_latency"]), ("put fresh", run["put_fresh_latency"])):
            print(f"{name:<4} {what} {format_size(latency['size'])} p50 {latency['p50_us']:.0f} us, "
                  f"p99 {latency['p99_us']:.0f} us", file=out)
        exists = run["batch_exists_latency"]
        print(f"{name:<4} batch_exists {exists['keys']} keys p50 {exists['p50_us']:.0f} us, "
              f"p99 {exists['p99_us']:.0f} us", file=out)
        for warning in run["client_warnings"]:
            print(f"{name:<4} client warning: {warning}", file=out)
    for name, why in report["skipped"].items():
        print(f"{name:<4} skipped: {why}", file=out)
    for name, target in report["targets"].items():
        print(f"target {name}: {_verdict(target)}", file=out)


def _verdict(target: dict) -> str:
    met = "" if target["met"] is None else f": {'met' if target['met'] else 'NOT met'}"
    if "ratio" in target:
        if target["ratio"] is None:
            return f"not measured ({target['note']})"
        return f"{target['ratio']:.2f} (aim >= {target['aim']:.2f}){met}"
    if "MBps" in target:
        if target["MBps"] is None:
            return "not measured"
        aim = f"aim >= {target['aim_MBps']:.0f} MB/s" if target["aim_MBps"] else "no aim"
        return f"{target['MBps']:.0f} MB/s ({aim}, Mooncake {target['mooncake_MBps']:.0f} MB/s){met}"
    mooncake = f", Mooncake {target['mooncake_us']:.0f} us" if "mooncake_us" in target else ""
    return f"{target['p50_us']:.0f} us (aim {target['aim_us']:.0f} us{mooncake}){met}"
