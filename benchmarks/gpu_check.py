"""CUDA memory through kvpool on one GPU: rates, byte-exactness and stream discipline, measured in one run.

    python benchmarks/gpu_check.py [--quick] [--out FILE]

Starts a local cluster (etcd, a master, two storage nodes on this host) and measures, in the same run:
  pinned     the GPU's own copy rates between device memory and page-locked host memory (torch pinned tensor,
             copy_(non_blocking=True) timed with CUDA events), device->host and host->device, per size;
  device     put_from + get_into of 4, 16 and 64 MiB CUDA tensors of random bytes, through shm and through tcp
             (a client per transport), median of several repetitions after a warm-up; every get is compared
             with its source on the GPU and the wrong bytes counted;
  host       the same calls with CPU tensors (kvpool's host path), same sizes and transports;
  paged      a vLLM-shaped paged KV cache on the GPU (32 layers, each (2, num_blocks, 16, 8, 128) bf16): 256
             blocks saved with the connector's KVBlockStore.save and loaded into other block ids with .load,
             source and destination blocks compared byte for byte;
  syncs      host waits the pipeline must never make while a kvpool call runs: torch.cuda.synchronize,
             Stream.synchronize (any stream), and Event.synchronize / Event.query on an event not recorded on
             the client's copy stream.
Prints one JSON line; "aims" holds each aim as a boolean (null when not measured), "aim_figures" the ratios.
Every wait is bounded: past --budget seconds the line is printed with an "error" and the cluster is killed.
Exit status 0 when everything ran and no byte was wrong, else 1 (the aims do not change it).

The hidden `--engine cpu` runs the same measurements with client.device.cpu.CpuCopyEngine buffers in place of
CUDA tensors (no pinned rates; the paged cache on CPU tensors when torch is there), to exercise the script
on a machine without a GPU.
"""

import argparse
import hashlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import uuid

from gpu_check_support import (CpuEngineMemory, EngineWatch, NumpyMemory, Report, SyncWatch, TorchMemory,
                               Watchdog, kill_cluster)

MIB = 1024 * 1024
GB = 1e9
SIZES_MIB = (4, 16, 64)
NODES = 2
AIM_SHM_VS_PINNED = 0.7
AIM_TCP_DEVICE_VS_HOST = 0.8
BLOCK_TOKENS, KV_HEADS, HEAD_DIM = 16, 8, 128  # one block of one layer's K (or V): 16 x 8 x 128 bf16, 32 KiB

# (reps, warmup, paged layers, paged num_blocks, paged blocks, paged reps) per engine and size of run
PLANS = {
    ("cuda", False): dict(reps=7, warmup=2, layers=32, num_blocks=600, blocks=256, paged_reps=3),
    ("cuda", True): dict(reps=3, warmup=1, layers=32, num_blocks=600, blocks=256, paged_reps=1),
    ("cpu", False): dict(reps=5, warmup=1, layers=8, num_blocks=160, blocks=64, paged_reps=2),
    ("cpu", True): dict(reps=2, warmup=1, layers=4, num_blocks=80, blocks=32, paged_reps=1),
}


# -- measurements

def median(values: list) -> float:
    return statistics.median(values) if values else float("nan")


def gbps(nbytes: float, seconds: float):
    return round(nbytes / seconds / GB, 3) if seconds > 0 else None


def pinned_rates(torch, sizes: list, reps: int) -> dict:
    """Device->host and host->device over pinned memory on a stream of its own, timed with CUDA events."""
    stream = torch.cuda.Stream()
    rates = {}
    for nbytes in sizes:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        row = {}
        for name, dest, source in (("d2h", host, device), ("h2d", device, host)):
            times = []
            with torch.cuda.stream(stream):
                for rep in range(reps + 2):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(stream)
                    dest.copy_(source, non_blocking=True)
                    end.record(stream)
                    end.synchronize()
                    if rep >= 2:
                        times.append(start.elapsed_time(end) / 1e3)
            row[f"{name}_gbps"] = gbps(nbytes, median(times))
            row[f"{name}_ms_p50"] = round(median(times) * 1e3, 3)
        row["combined_gbps"] = round(1 / (1 / row["d2h_gbps"] + 1 / row["h2d_gbps"]), 3)
        rates[f"{nbytes // MIB}MiB"] = row
        del host, device
    return rates


def transfer_rates(client, memory, sizes: list, reps: int, warmup: int, watch, tag: str, report: Report) -> dict:
    """put_from + get_into of each size: medians of `reps` after `warmup`, every get checked."""
    rows = {}
    run = uuid.uuid4().hex[:8]
    # First contact with each node (connections, its segment mapped and registered for DMA) before any timing:
    # eight keys, so that both nodes are all but surely among their placements.
    report.section = f"{tag} first contact"
    source, dest = memory.make(MIB, seed=1)
    for i in range(8):
        key = f"gpu-check/{run}/{tag}/first/{i}"
        client.put_from(key, source)
        client.get_into(key, dest)
        client.remove(key)
    for nbytes in sizes:
        label = f"{nbytes // MIB}MiB"
        report.section = f"{tag} {label}"
        source, dest = memory.make(nbytes, seed=nbytes + len(tag))
        puts, gets, trips, wrong, short = [], [], [], 0, 0
        for rep in range(warmup + reps):
            key = f"gpu-check/{run}/{tag}/{label}/{rep}"
            memory.scramble(source, dest)
            memory.settle()
            with watch:
                start = time.perf_counter()
                client.put_from(key, source)
                put_done = time.perf_counter()
                got = client.get_into(key, dest)
                get_done = time.perf_counter()
            memory.settle()
            wrong += memory.wrong(source, dest) + abs(nbytes - got)
            short += got != nbytes
            client.remove(key)
            if rep >= warmup:
                puts.append(put_done - start)
                gets.append(get_done - put_done)
                trips.append(get_done - start)
        rows[label] = {"put_gbps": gbps(nbytes, median(puts)), "get_gbps": gbps(nbytes, median(gets)),
                       "round_trip_gbps": gbps(nbytes, median(trips)),
                       "put_ms_p50": round(median(puts) * 1e3, 3), "get_ms_p50": round(median(gets) * 1e3, 3),
                       "reps": reps, "wrong_bytes": wrong, "short_gets": short}
        del source, dest
    return rows


def paged_cache(torch, device: str, plan: dict, client, watch, transport: str, report: Report) -> dict:
    """KVBlockStore.save of `blocks` blocks of a vLLM-shaped paged cache, .load into other block ids."""
    from kvpool.connectors.block_keys import BlockNamespace
    from kvpool.connectors.block_store import KVBlockStore
    from kvpool.connectors.paged_layout import block_bytes

    layers, num_blocks, blocks = plan["layers"], plan["num_blocks"], plan["blocks"]
    if num_blocks < 2 * blocks:
        raise ValueError(f"{num_blocks} blocks cannot hold {blocks} sources and {blocks} destinations")
    generator = torch.Generator(device=device).manual_seed(1234)
    shape = (2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM * 2)  # bytes, seen as bf16 below
    caches = [torch.randint(0, 256, shape, dtype=torch.uint8, device=device, generator=generator)
              .view(torch.bfloat16) for _ in range(layers)]
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(99))
    sources, dests = order[:blocks].tolist(), order[blocks:2 * blocks].tolist()
    source_index = torch.tensor(sources, device=device)
    dest_index = torch.tensor(dests, device=device)
    size = block_bytes(caches)
    memory = TorchMemory(torch, device)
    saves, loads, wrong, saved_counts, loaded_counts = [], [], 0, [], []
    run = uuid.uuid4().hex[:8]
    for rep in range(1 + plan["paged_reps"]):  # the first is a warm-up
        report.section = f"paged {transport} rep {rep}"
        namespace = BlockNamespace(model=f"gpu-check-{run}-{transport}-{rep}", dtype="bfloat16", layout="vllm-nhd",
                                   block_size=BLOCK_TOKENS)
        store = KVBlockStore(client, namespace, kv_first=True)
        hashes = [hashlib.sha256(f"{run}/{rep}/{i}".encode()).hexdigest() for i in range(blocks)]
        for cache in caches:
            cache.view(torch.uint8)[:, dest_index] = 0
        memory.settle()
        with watch:
            start = time.perf_counter()
            saved = store.save(hashes, sources, caches)
        saved_at = time.perf_counter()
        with watch:
            loaded = store.load(hashes, dests, caches)
        memory.settle()  # the scatter kernels (enqueued on the current stream) done: the blocks are in place
        loaded_at = time.perf_counter()
        for cache in caches:
            raw = cache.view(torch.uint8)
            wrong += int((raw[:, source_index] != raw[:, dest_index]).sum().item())
        client.remove_prefix(namespace.prefix())
        saved_counts.append(saved)
        loaded_counts.append(loaded)
        if rep >= 1:
            saves.append(saved_at - start)
            loads.append(loaded_at - saved_at)
    del caches
    return {"layers": layers, "num_blocks": num_blocks, "layer_shape": [2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM],
            "dtype": "bfloat16", "blocks": blocks, "block_bytes": size, "reps": plan["paged_reps"],
            "save_blocks_per_s": round(blocks / median(saves), 1), "load_blocks_per_s": round(blocks / median(loads), 1),
            "save_gbps": gbps(blocks * size, median(saves)), "load_gbps": gbps(blocks * size, median(loads)),
            "save_ms_p50": round(median(saves) * 1e3, 2), "load_ms_p50": round(median(loads) * 1e3, 2),
            "saved": saved_counts, "loaded": loaded_counts, "wrong_bytes": wrong}


# -- the run

def dev_shm_free() -> int | None:
    """Free bytes of /dev/shm, where each node's DRAM segment lies when it fits (else in anonymous memory, and
    the node then offers no shared memory: the shm rows fail, and say so)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def environment(torch, engine: str) -> dict:
    info = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    try:
        import kvpool
        info["kvpool"] = getattr(kvpool, "__version__", None)
        info["kvpool_path"] = os.path.dirname(kvpool.__file__)
    except Exception as exc:
        info["kvpool"] = f"not importable: {exc}"
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.version.cuda
    if engine == "cuda" and torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = torch.cuda.get_device_name(0)
        info["device_memory_bytes"] = props.total_memory
        info["capability"] = f"{props.major}.{props.minor}"
        info["device_count"] = torch.cuda.device_count()
        try:
            info["cuda_driver"] = torch._C._cuda_getDriverVersion()
        except Exception:
            pass
    return info


def import_torch():
    try:
        import torch
        return torch, None
    except Exception as exc:  # ImportError, or a broken install
        return None, f"{type(exc).__name__}: {exc}"


def ratio_aim(rows: dict, baselines: dict, field: str, largest: str, aim: float, figure: str, aim_name: str,
              figures: dict, met: dict) -> None:
    """met[aim_name]: the round trip of `rows` over the baseline's `field` at size `largest` reaches `aim` (None:
    not measured); figures[figure]: that ratio and the ratio per size."""
    if not (rows and baselines):
        met[aim_name] = None
        return
    per_size = {label: round(row["round_trip_gbps"] / baselines[label][field], 3) for label, row in rows.items()
                if label in baselines and row["round_trip_gbps"] and baselines[label][field]}
    ratio = per_size.get(largest)
    figures[figure] = {"size": largest, "ratio": ratio, "aim": aim, "per_size": per_size}
    met[aim_name] = None if ratio is None else ratio >= aim


def aims(data: dict, largest: str) -> tuple[dict, dict]:
    figures, met = {}, {}
    kv = data.get("kvpool") or {}
    shm, tcp = kv.get("shm") or {}, kv.get("tcp") or {}
    ratio_aim(shm.get("device") or {}, data.get("pinned") or {}, "combined_gbps", largest, AIM_SHM_VS_PINNED,
              "shm_round_trip_vs_pinned", "shm_round_trip_ge_0.7_pinned", figures, met)
    ratio_aim(tcp.get("device") or {}, tcp.get("host") or {}, "round_trip_gbps", largest, AIM_TCP_DEVICE_VS_HOST,
              "tcp_device_vs_host", "tcp_device_ge_0.8_host", figures, met)
    wrong = [row["wrong_bytes"] for side in kv.values() for rows in side.values() for row in rows.values()]
    wrong += [row["wrong_bytes"] for row in (data.get("paged") or {}).values() if isinstance(row, dict)
              and "wrong_bytes" in row]
    figures["wrong_bytes"] = sum(wrong) if wrong else None
    met["zero_wrong_bytes"] = None if not wrong else sum(wrong) == 0
    syncs = data.get("syncs")
    figures["stream_syncs"] = None if syncs is None else syncs["total"]
    met["no_stream_syncs"] = None if syncs is None else syncs["total"] == 0
    return met, figures


def run(args, report: Report, watchdog: Watchdog) -> None:
    data = report.data
    plan = dict(PLANS[(args.engine, args.quick)])
    sizes = [size * MIB for size in SIZES_MIB]
    data.update(engine=args.engine, quick=args.quick)
    torch, torch_error = import_torch()
    report.section = "environment"
    if args.engine == "cuda":
        if torch is None:
            data["error"] = "no CUDA device"
            data["detail"] = f"torch is not importable ({torch_error})"
            data["host"] = environment(None, "cuda")
            return
        if not torch.cuda.is_available():
            data["error"] = "no CUDA device"
            data["detail"] = f"torch.cuda.is_available() is False (torch {torch.__version__}, " \
                             f"built for CUDA {torch.version.cuda})"
            data["host"] = environment(torch, "cuda")
            return
    data["host"] = environment(torch, args.engine)

    from kvpool.launch.local_cluster import LocalCluster
    from kvpool import Client

    dram, shm_free = (2048 if args.engine == "cuda" else 1024) * MIB, dev_shm_free()
    if shm_free is not None and shm_free < NODES * dram:
        data["note"] = (f"/dev/shm has {shm_free} bytes free, less than {NODES} segments of {dram}: "
                        "the nodes keep their DRAM in anonymous memory and offer no shared memory")
    data["settings"] = {"sizes_mib": list(SIZES_MIB), "reps": plan["reps"], "warmup": plan["warmup"], "nodes": NODES,
                        "dram_per_node_bytes": dram, "dev_shm_free_bytes": shm_free, "budget_s": args.budget,
                        "gb": "1e9 bytes", "paged": {k: plan[k] for k in ("layers", "num_blocks", "blocks", "paged_reps")}}

    work = tempfile.mkdtemp(prefix="kvpool-gpu-check-")
    watchdog.work_dir = work
    # The cluster's processes run `python -m kvpool...` from the working directory: a source checkout there
    # (whose kvpool/ is not the installed package) would shadow what is installed.
    os.chdir(work)
    os.environ["PYTHONSAFEPATH"] = "1"
    clients: dict = {}
    engines: list = []
    watch = None
    cluster = LocalCluster(nodes=NODES, dram_per_node=f"{dram // MIB}MiB", data_dir=os.path.join(work, "cluster"))
    watchdog.cluster = cluster
    try:
        report.section = "cluster start"
        started = time.monotonic()
        cluster.start(timeout=90)
        data["cluster_start_s"] = round(time.monotonic() - started, 2)

        def client(name: str, transport: str, engine=None):
            clients[name] = Client(cluster.master_address, transports=transport, timeout=60.0, copy_engine=engine)
            return clients[name]

        if args.engine == "cuda":
            def copy_streams():
                return [getattr(c._core.devices.engine, "_stream", None) for c in clients.values()
                        if c._core.devices.engine is not None]
            watch = SyncWatch(torch, copy_streams)
            report.section = "pinned copy rates"
            try:
                data["pinned"] = pinned_rates(torch, sizes, plan["reps"])
            except Exception as exc:
                report.fail("pinned", exc)
        else:
            from kvpool.client.device.cpu import CpuCopyEngine
            watch = EngineWatch(engines)

        data["kvpool"] = {}
        for transport in ("shm", "tcp"):
            rows = data["kvpool"][transport] = {}
            for side in ("device", "host"):
                try:
                    if side == "device" and args.engine == "cuda":
                        kv, memory = client(f"device-{transport}", transport), TorchMemory(torch, "cuda")
                    elif side == "device":
                        engine = CpuCopyEngine()
                        engines.append(engine)
                        kv, memory = client(f"device-{transport}", transport, engine), CpuEngineMemory(engine)
                    else:
                        kv = client(f"host-{transport}", transport)
                        memory = TorchMemory(torch, "cpu") if torch is not None else NumpyMemory()
                    rows[side] = transfer_rates(kv, memory, sizes, plan["reps"], plan["warmup"],
                                                watch if side == "device" else _Nothing(), f"{side}-{transport}",
                                                report)
                except Exception as exc:
                    report.fail(f"{side} {transport}", exc)

        data["paged"] = {}
        for transport in ("shm", "tcp"):
            if torch is None:
                data["paged"][transport] = "skipped: torch is not installed"
                continue
            try:
                kv = clients.get(f"device-{transport}") if args.engine == "cuda" else clients.get(f"host-{transport}")
                if kv is None:
                    kv = client(f"paged-{transport}", transport)
                data["paged"][transport] = paged_cache(torch, "cuda" if args.engine == "cuda" else "cpu", plan, kv,
                                                       watch if args.engine == "cuda" else _Nothing(), transport,
                                                       report)
            except Exception as exc:
                report.fail(f"paged {transport}", exc)

        report.section = "report"
        data["syncs"] = watch.report()
        data["clients"] = {}
        for name, kv in clients.items():
            try:
                data["clients"][name] = {"bytes_by_transport": kv.bytes_by_transport(),
                                         "device_memory": kv.device_memory()}
            except Exception as exc:
                report.fail(f"report {name}", exc)
        data["checks"] = carried(data["clients"], "cuda" if args.engine == "cuda" else "cpu-device")
        data["aims"], data["aim_figures"] = aims(data, f"{SIZES_MIB[-1]}MiB")
    finally:
        report.section = "shutdown"
        if watch is not None:
            watch.restore()
        for kv in clients.values():
            try:
                kv.close()
            except Exception as exc:
                print(f"gpu_check: closing a client: {exc}", file=sys.stderr, flush=True)
        try:
            cluster.stop()
        except Exception as exc:
            report.fail("cluster stop", exc)
            kill_cluster(cluster)
        os.chdir("/")
        shutil.rmtree(work, ignore_errors=True)


def carried(clients: dict, engine: str) -> dict:
    """Whether each client's bytes went the way it was told (else its figures are not that transport's)."""
    checks = {}
    for name, row in clients.items():
        moved = row["bytes_by_transport"]
        transport = name.split("-", 1)[1]
        others = [t for t in ("shm", "ucx", "tcp", "shared") if t != transport and moved.get(t)]
        checks[f"{name}_only_{transport}"] = bool(moved.get(transport)) and not others
        if name.startswith("device-"):
            path = "direct" if transport == "shm" else "staged"
            checks[f"{name}_{engine}:{path}"] = bool(moved.get(f"{engine}:{path}"))
    return checks


class _Nothing:
    """A watch for the host-path calls: nothing to count."""

    def __enter__(self):
        pass

    def __exit__(self, *exc):
        pass


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--out", help="also write the JSON line to this file")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds the whole run may take; past it the line is printed with an error (420)")
    parser.add_argument("--engine", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = os.path.abspath(args.out) if args.out else None
    report = Report(out)
    watchdog = Watchdog(report, args.budget)
    try:
        run(args, report, watchdog)
    except BaseException as exc:  # also KeyboardInterrupt: the line still goes out
        report.fail(report.section, exc)
    finally:
        watchdog.stop()
    report.emit()
    data = report.data
    wrong = (data.get("aim_figures") or {}).get("wrong_bytes")
    return 1 if data.get("error") or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
