"""The cost of Mooncake's client surface on kvpool, and Mooncake itself, on the same operations in one sitting.

Three sides run the same round (put then get of 64 KiB and of 4 MiB values, batch_put_from then batch_get_into
of 64 x 1 MiB from a registered buffer, and the latency of single 64 KiB gets):
  client   kvpool's own Client (put, get, batch_put, batch_get_into)
  shim     kvpool.compat.mooncake.MooncakeDistributedStore on the same cluster (put, get, batch_put_from,
           batch_get_into on registered addresses)
  mooncake Mooncake Store itself (../shared/peers/mooncake: its venv, master and metadata server, a storage
           process holding the segment, so bytes cross loopback TCP as kvpool's do), through the same calls as shim
Rounds alternate the sides (each round a fresh process per side); reported are the medians per side and
operation, and per round the ratios shim / client (the shim's cost) and shim / mooncake. kvpool's client is held
to TCP (--transports) so the three move bytes the same way. One JSON line on stdout.

    python benchmarks/mooncake_shim.py --rounds 5                 # starts a kvpool cluster and Mooncake
    python benchmarks/mooncake_shim.py --rounds 3 --no-mooncake   # the shim against kvpool's client only
"""

import argparse
import ctypes
import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

KIB, MIB = 1 << 10, 1 << 20
HERE = Path(__file__).resolve()
PEER = HERE.parents[2] / "shared" / "peers" / "mooncake"
SIDES = ("client", "shim", "mooncake")


# ---------------------------------------------------------------- one round of one side (a process of its own)

class Ops:
    """The calls a round makes, for one side: put(key, bytes), get(key) -> bytes, batch_put_from(keys, i),
    batch_get_into(keys, i) (i: where in the registered buffer), remove(keys)."""

    def __init__(self, side: str, args, region: mmap.mmap):
        self.region = region
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        if side == "client":
            from kvpool import Client

            self.client = Client(args.master, transports=args.transports)
            self.view = memoryview(region)
            return
        if side == "shim":
            os.environ["KVPOOL_TRANSPORTS"] = args.transports
            from kvpool.compat.mooncake import MooncakeDistributedStore
        else:
            from mooncake.store import MooncakeDistributedStore
        self.store = MooncakeDistributedStore()
        # 512 MiB of local buffer, as Mooncake's own benchmark gives it (get stages values there)
        rc = self.store.setup("127.0.0.1", args.metadata, 0, 512 * MIB, "tcp", "", args.master)
        assert rc == 0, f"setup returned {rc}"
        assert self.store.register_buffer(self.base, len(region)) == 0
        self.client = None

    def put(self, key, value) -> None:
        if self.client:
            self.client.put(key, value)
        else:
            assert self.store.put(key, value) == 0

    def get(self, key) -> bytes:
        return self.client.get(key) if self.client else self.store.get(key)

    def batch_put_from(self, keys, size: int) -> None:
        if self.client:
            self.client.batch_put(keys, [self.view[i * size:(i + 1) * size] for i in range(len(keys))])
        else:
            codes = self.store.batch_put_from(keys, [self.base + i * size for i in range(len(keys))],
                                              [size] * len(keys))
            assert all(c == 0 for c in codes), codes

    def batch_get_into(self, keys, size: int, at: int) -> None:
        if self.client:
            got = self.client.batch_get_into(keys, [self.view[at + i * size:at + (i + 1) * size]
                                                    for i in range(len(keys))])
        else:
            got = self.store.batch_get_into(keys, [self.base + at + i * size for i in range(len(keys))],
                                            [size] * len(keys))
        assert got == [size] * len(keys), got

    def remove(self, keys) -> None:
        for key in keys:
            self.client.remove(key) if self.client else self.store.remove(key, True)

    def close(self) -> None:
        self.client.close() if self.client else self.store.close()


def timed(fn, count: int, nbytes: int) -> dict:
    start = time.perf_counter()
    for i in range(count):
        fn(i)
    seconds = time.perf_counter() - start
    return {"MB_s": round(count * nbytes / seconds / 1e6, 1), "ops_s": round(count / seconds, 1)}


def one_round(side: str, args) -> dict:
    batch, batch_size = 64, MIB
    region = mmap.mmap(-1, 2 * batch * batch_size)
    region[:batch * batch_size] = os.urandom(batch * batch_size)
    ops = Ops(side, args, region)
    tag = f"{side}-{os.getpid()}"
    warm = os.urandom(MIB)  # connections to the master and every node made before anything is timed
    keys = [f"{tag}/warm/{i}" for i in range(16)]
    for key in keys:
        ops.put(key, warm)
        assert ops.get(key) == warm
    ops.remove(keys)
    out = {}
    for name, size, count in (("64KiB", 64 * KIB, args.small_count), ("4MiB", 4 * MIB, args.large_count)):
        value = os.urandom(size)
        keys = [f"{tag}/{name}/{i}" for i in range(count)]
        out[f"put_{name}"] = timed(lambda i: ops.put(keys[i], value), count, size)
        out[f"get_{name}"] = timed(lambda i: ops.get(keys[i]), count, size)
        assert ops.get(keys[-1]) == value
        ops.remove(keys)
    rounds = args.batches
    keys = [[f"{tag}/batch/{b}/{i}" for i in range(batch)] for b in range(rounds)]
    out["batch_put_from_64x1MiB"] = timed(lambda b: ops.batch_put_from(keys[b], batch_size), rounds,
                                          batch * batch_size)
    out["batch_get_into_64x1MiB"] = timed(lambda b: ops.batch_get_into(keys[b], batch_size, batch * batch_size),
                                          rounds, batch * batch_size)
    assert region[:batch * batch_size] == region[batch * batch_size:]
    ops.remove([k for ks in keys for k in ks])
    value = os.urandom(64 * KIB)
    keys = [f"{tag}/lat/{i}" for i in range(64)]
    for key in keys:
        ops.put(key, value)
    samples = []
    for i in range(args.latency_samples):
        start = time.perf_counter_ns()
        ops.get(keys[i % len(keys)])
        samples.append(time.perf_counter_ns() - start)
    out["get_64KiB_p50_us"] = round(statistics.median(samples) / 1000, 1)
    ops.remove(keys)
    ops.close()
    return out


# ---------------------------------------------------------------- the driver

def run_side(python: str, side: str, args, master: str, env: dict) -> dict:
    argv = [python, str(HERE), "--side", side, "--master", master, "--metadata", args.metadata,
            "--transports", args.transports, "--small-count", str(args.small_count),
            "--large-count", str(args.large_count), "--batches", str(args.batches),
            "--latency-samples", str(args.latency_samples)]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    if run.returncode != 0:
        raise SystemExit(f"{side} round failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


class Mooncake:
    """Mooncake's metadata server, master and a storage process holding the segment (as its own benchmark's
    two-process mode), from the peer's venv."""

    def __init__(self, venv: Path, segment_mib: int):
        self.python = str(venv / "bin" / "python")
        self.env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.procs = []
        logs = Path(tempfile.mkdtemp(prefix="mooncake-bench-"))
        self._start([str(venv / "bin" / "mooncake_http_metadata_server"), "--host", "127.0.0.1", "--port",
                     str(self.META_PORT), "--log-level", "WARNING"], logs / "meta.log")
        self._start([str(venv / "bin" / "mooncake_master"), "--rpc_address=127.0.0.1",
                     f"--rpc_port={self.MASTER_PORT}", "--metrics_host=127.0.0.1", "--metrics_port=9013",
                     "--enable_metric_reporting=false"], logs / "master.log")
        self._wait_port(self.META_PORT)
        self._wait_port(self.MASTER_PORT)
        storage = subprocess.Popen([self.python, str(HERE), "--side", "mooncake-storage", "--master",
                                    self.master, "--metadata", self.metadata, "--segment-mib", str(segment_mib)],
                                   stdout=subprocess.PIPE, stderr=open(logs / "storage.log", "w"), text=True,
                                   env=self.env)
        self.procs.append(storage)
        line = storage.stdout.readline()
        if not line.startswith("READY"):
            self.stop()
            raise SystemExit(f"Mooncake's storage process did not start: see {logs}/storage.log")

    META_PORT, MASTER_PORT = 18080, 50061
    master = f"127.0.0.1:{MASTER_PORT}"
    metadata = f"http://127.0.0.1:{META_PORT}/metadata"

    def _start(self, argv, log: Path) -> None:
        self.procs.append(subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=self.env))

    @staticmethod
    def _wait_port(port: int) -> None:
        import socket

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.1)
        raise SystemExit(f"Mooncake did not listen on {port} within 30 s")

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def storage_role(args) -> None:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", args.metadata, args.segment_mib * MIB, 16 * MIB, "tcp", "", args.master) == 0
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])  # taken by sigwait below, not by a handler
    print("READY", flush=True)
    signal.sigwait([signal.SIGTERM])
    store.close()


def drive(args) -> dict:
    from kvpool.launch.local_cluster import LocalCluster

    sides = ["client", "shim"] + ([] if args.no_mooncake else ["mooncake"])
    mooncake = None
    if not args.no_mooncake:
        venv = Path(args.mooncake_venv)
        if not (venv / "bin" / "mooncake_master").exists():
            raise SystemExit(f"no Mooncake venv at {venv}: run {PEER}/setup.sh first, or pass --no-mooncake")
        mooncake = Mooncake(venv, args.segment_mib)
    per_side = {side: [] for side in sides}
    try:
        with LocalCluster(nodes=2, dram_per_node=f"{args.segment_mib // 2}MiB") as cluster:
            env = {k: v for k, v in os.environ.items() if k != "KVPOOL_TOKEN_FILE"}
            env["KVPOOL_TOKEN"] = cluster.client_token
            for _ in range(args.rounds):
                for side in sides:
                    if side == "mooncake":
                        per_side[side].append(run_side(mooncake.python, side, args, mooncake.master, mooncake.env))
                    else:
                        per_side[side].append(run_side(sys.executable, side, args, cluster.master_address, env))
    finally:
        if mooncake:
            mooncake.stop()
    ops = list(per_side["client"][0])
    medians = {side: {op: statistics.median(_figure(r[op]) for r in rounds) for op in ops}
               for side, rounds in per_side.items()}
    return {"bench": "mooncake_shim", "rounds": args.rounds, "transports": args.transports,
            "units": "MB/s; get_64KiB_p50_us in microseconds; ratios: the shim's speed over the other's, per "
                     "round, median (above 1: the shim is faster, for the latency too)",
            "median": medians, "ratio_median": speed_ratios(per_side), "per_round": per_side,
            "cpus": os.cpu_count(), "loadavg": os.getloadavg()}


def speed_ratios(per_side: dict) -> dict:
    """shim_vs_<side>: per operation, the median over rounds of the shim's speed / that side's (latency inverted)."""
    ops = list(per_side["shim"][0])
    return {f"shim_vs_{other}": {op: round(statistics.median(_speed(op, s[op]) / _speed(op, o[op])
                                                          for s, o in zip(per_side["shim"], rounds)), 3)
                                 for op in ops}
            for other, rounds in per_side.items() if other != "shim"}


def _figure(entry) -> float:
    return entry["MB_s"] if isinstance(entry, dict) else entry


def _speed(op: str, entry) -> float:
    return 1 / entry if op.endswith("_us") else _figure(entry)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-mooncake", action="store_true", help="compare the shim with kvpool's client only")
    parser.add_argument("--mooncake-venv", default="/tmp/anchor/mc-venv", help="where the peer's setup.sh put it")
    parser.add_argument("--segment-mib", type=int, default=2048, help="pool size of each store")
    parser.add_argument("--transports", default="tcp")
    parser.add_argument("--small-count", type=int, default=1024, help="64 KiB values per round")
    parser.add_argument("--large-count", type=int, default=64, help="4 MiB values per round")
    parser.add_argument("--batches", type=int, default=8, help="batches of 64 x 1 MiB per round")
    parser.add_argument("--latency-samples", type=int, default=2000)
    parser.add_argument("--side", choices=[*SIDES, "mooncake-storage"], help=argparse.SUPPRESS)
    parser.add_argument("--master", help=argparse.SUPPRESS)
    parser.add_argument("--metadata", default="http://127.0.0.1:18080/metadata", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "mooncake-storage":
        return storage_role(args)
    if args.side:
        print(json.dumps(one_round(args.side, args)), flush=True)
        return
    print(json.dumps(drive(args)), flush=True)


if __name__ == "__main__":
    main()
