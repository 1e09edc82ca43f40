"""Load for a rolling upgrade (tests/e2e/test_rolling_upgrade.py), run as a script under whichever release is
first on PYTHONPATH, using only the client API every release has: puts of new keys (two copies, each
acknowledged once flush() says the master ended it) and gets of ones acknowledged, checked byte for byte, until STOP_FILE exists; then one JSON line on stdout. PROGRESS_FILE
holds how many puts were acknowledged so far.

argv: ETCD_ENDPOINT CLUSTER STOP_FILE PROGRESS_FILE"""

import hashlib
import json
import os
import random
import sys
import time

from kvpool import Client

SIZE = 16 << 10
TIMEOUT = 5.0  # every call's deadline
SLACK = 1.0  # what a call may take past it before it counts as past its deadline


def value_of(key: str) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (seed * (SIZE // 64))[:SIZE]


class Load:
    def __init__(self):
        self.acknowledged, self.failures, self.wrong, self.late = [], {}, [], []

    def timed(self, op: str, call):
        """call()'s result, or None after counting its error by type; a call past its deadline is noted."""
        began = time.monotonic()
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - a typed error within the deadline is allowed, and counted
            name = f"{op} {type(exc).__name__}"
            self.failures[name] = self.failures.get(name, 0) + 1
            return None
        finally:
            took = time.monotonic() - began
            if took > TIMEOUT + SLACK:
                self.late.append([op, round(took, 2)])


def main() -> int:
    etcd, cluster, stop_file, progress_file = sys.argv[1:5]
    load, rng = Load(), random.Random(7)
    with Client(etcd=etcd, cluster=cluster, replicas=2, timeout=TIMEOUT) as client:
        i = 0
        while not os.path.exists(stop_file):
            key = f"upgrade/{i:06d}"
            i += 1
            # A put is acknowledged once the master answered its end: flush() raises for one it could not end
            # (a takeover may drop a put in flight), and that value is not stored.
            if load.timed("put", lambda: client.put(key, value_of(key)) or True) \
                    and load.timed("flush", lambda: client.flush() or True):
                load.acknowledged.append(key)
            if load.acknowledged:
                old = rng.choice(load.acknowledged)
                value = load.timed("get", lambda: client.get(old))
                if value is not None and value != value_of(old):
                    load.wrong.append(old)
            with open(progress_file + ".tmp", "w") as f:
                f.write(str(len(load.acknowledged)))
            os.replace(progress_file + ".tmp", progress_file)
            time.sleep(0.02)  # a steady trickle: the pool's DRAM holds every copy for the whole test
    print(json.dumps({"acknowledged": load.acknowledged, "failures": load.failures, "wrong": load.wrong,
                      "late": load.late}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
