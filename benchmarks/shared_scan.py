"""How fast a node adopts the shared tier: a scan over manifests of `--records` records in all, in a directory
(SharedDir) or, with `--object-store local`, in a bucket on a real S3 server (BucketTier).

Writes the manifests of `--writers` writers into a fresh directory (records only, no object files: the scan
never opens one): keys like an engine's block keys, one ADDED per object, and among them a tenth superseded
by a newer generation, a tenth removed and a twentieth expired, so the fold has each case to do. Then times
one scan, with the manifests in the page cache. Prints one JSON line (wall and CPU seconds).

In a bucket a writer's manifest is a run of objects, one per batch it wrote (`--records-per-manifest`, 32 for
the sweep's batches), until a scan finds more than 64 and folds them into objects of 100,000 records: the line
then has the first scan as a reader sees it (`seconds`), the scan of a node (`node_scan_seconds`), the fold it
makes after answering (`fold_seconds`) and the scan after that fold (`after_fold_seconds`), what every later
adoption takes.

    .venv/bin/python benchmarks/shared_scan.py                    # 1,000,000 records, 2 writers
    .venv/bin/python benchmarks/shared_scan.py --records 200000
    .venv/bin/python benchmarks/shared_scan.py --object-store local --records-per-manifest 32
"""

import argparse
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvpool.protocol.inventory import Reply
from kvpool.sharedfs.files import SharedDir
from kvpool.sharedfs.layout import ADDED, REMOVED, SharedObject, pack_record

NOW_MS = 1_800_000_000_000


def manifest_records(writer: int, writers: int, records: int):
    """This writer's share of the records: (op, object) in append order."""
    written = 0
    i = writer
    while written < records:
        obj = SharedObject(f"model-x/layer-{i % 61:02d}/block-{i:010x}".encode(), 100 + i, 65536, i * 2654435761,
                           0, 65536, NOW_MS - 1000 if i % 20 == 7 else 0 if i % 2 else NOW_MS + 60_000 * (1 + i % 3))
        yield ADDED, obj
        written += 1
        if i % 10 == 3 and written < records:
            yield ADDED, obj._replace(generation=obj.generation + 1)
            written += 1
        elif i % 10 == 5 and written < records:
            yield REMOVED, obj
            written += 1
        i += writers


def timed(scan):
    started, cpu_started = time.perf_counter(), time.process_time()
    result = scan(NOW_MS)
    return result, time.perf_counter() - started, time.process_time() - cpu_started


def in_bucket(args) -> dict:
    """The scans of a bucket holding the writers' manifests as runs of objects of `records_per_manifest`."""
    from kvpool.launch.s3_server import S3Server
    from kvpool.objectstore.bucket import Bucket
    from kvpool.objectstore.tier import BucketTier
    from kvpool.sharedfs.layout import MANIFEST_SUFFIX, MANIFESTS_DIR

    with tempfile.TemporaryDirectory() as root, S3Server(Path(root) / "s3") as server:
        bucket = Bucket(server.settings("scan/"), timeout=60)
        names, bodies = [], []
        for writer in range(args.writers):
            share = args.records // args.writers + (writer < args.records % args.writers)
            records = [pack_record(op, obj) for op, obj in manifest_records(writer, args.writers, share)]
            for sequence, start in enumerate(range(0, len(records), args.records_per_manifest)):
                names.append(f"bench/{MANIFESTS_DIR}/node-{writer}/{sequence:016x}{MANIFEST_SUFFIX}")
                bodies.append(b"".join(records[start:start + args.records_per_manifest]))
        with ThreadPoolExecutor(16) as threads:
            for _ in threads.map(bucket.put, names, bodies):
                pass
        result = {"manifest_objects": len(names)}
        with BucketTier.reader(bucket, "bench") as reader:
            scan, result["seconds"], result["cpu_seconds"] = timed(reader.scan)
        if len(names) > 64:  # a node's scan folds them; every later one reads the fold
            with BucketTier(bucket, "bench", "scanner") as node:  # its scan answers, then it folds
                _, result["node_scan_seconds"], _ = timed(node.scan)
                started = time.perf_counter()
                node.wait_for_folds()
                result["fold_seconds"] = time.perf_counter() - started
            with BucketTier.reader(bucket, "bench") as reader:
                after, result["after_fold_seconds"], result["after_fold_cpu_seconds"] = timed(reader.scan)
            assert len(Reply(after.reply)) == len(Reply(scan.reply))
            result["manifests_after_fold"] = after.manifests
    return scan, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--object-store", choices=["local"], help="the manifests in a bucket of an S3 server run here")
    parser.add_argument("--records-per-manifest", type=int, default=100_000, metavar="N",
                        help="records per manifest object in the bucket (32: as the sweep's batches leave them)")
    args = parser.parse_args()
    if args.object_store:
        scan, timings = in_bucket(args)
        print(json.dumps({"store": "bucket", "records": scan.records, "manifests": scan.manifests,
                          "live": len(Reply(scan.reply)), "superseded": len(scan.superseded),
                          "expired": len(scan.expired), "records_per_second": round(scan.records / timings["seconds"]),
                          **{name: round(value, 3) if isinstance(value, float) else value
                             for name, value in timings.items()}}))
        return
    with tempfile.TemporaryDirectory() as root:
        shared = SharedDir(root, "bench", "scanner")
        for writer in range(args.writers):
            share = args.records // args.writers + (writer < args.records % args.writers)
            with open(os.path.join(shared.manifests_dir, f"node-{writer}.log"), "wb") as f:
                f.write(b"".join(pack_record(op, obj) for op, obj in manifest_records(writer, args.writers, share)))
        started, cpu_started = time.perf_counter(), time.process_time()
        scan = shared.scan(NOW_MS)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
        shared.close()
    print(json.dumps({"records": scan.records, "manifests": scan.manifests, "live": len(Reply(scan.reply)),
                      "superseded": len(scan.superseded), "expired": len(scan.expired),
                      "seconds": round(seconds, 3), "records_per_second": round(scan.records / seconds),
                      # the process's own CPU time: what a busy machine's other work does not add to
                      "cpu_seconds": round(cpu_seconds, 3)}))


if __name__ == "__main__":
    main()
