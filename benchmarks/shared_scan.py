"""How fast a node adopts the shared tier: SharedDir.scan over manifests of `--records` records in all.

Writes the manifests of `--writers` writers into a fresh directory (records only, no object files: the scan
never opens one): keys like an engine's block keys, one ADDED per object, and among them a tenth superseded
by a newer generation, a tenth removed and a twentieth expired, so the fold has each case to do. Then times
one scan, with the manifests in the page cache. Prints one JSON line (wall and CPU seconds).

    .venv/bin/python benchmarks/shared_scan.py                    # 1,000,000 records, 2 writers
    .venv/bin/python benchmarks/shared_scan.py --records 200000
"""

import argparse
import json
import os
import tempfile
import time

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--writers", type=int, default=2)
    args = parser.parse_args()
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
