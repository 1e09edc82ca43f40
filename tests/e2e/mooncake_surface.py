"""Cases of Mooncake Store's Python client surface, run against any `MooncakeDistributedStore` that was set up.

The same function runs against Mooncake itself (0.3.13, to record what it answers: mooncake_surface.json) and
against kvpool's drop-in (tests/e2e/test_mooncake_compat.py compares the two). Only the standard library and the
store are used, so it runs in Mooncake's own venv:

    python tests/e2e/mooncake_surface.py --master HOST:PORT --metadata URL  > answers.json
"""

import ctypes
import json
import mmap
import sys

BUFFER = 1 << 20  # the registered buffer: sources in its first half, destinations in its second


def _address(region) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def cases(store, tag: str) -> dict:
    """case name -> what the store answered (bytes as a list of ints' length and head, so JSON holds them)."""
    out = {}
    k = lambda name: f"{tag}/{name}"  # noqa: E731

    def record(name, fn):
        try:
            value = fn()
        except Exception as exc:  # what raises, by type name: part of the surface too
            value = {"raises": type(exc).__name__}
        if isinstance(value, (bytes, bytearray)):
            value = {"bytes": bytes(value).hex()}
        elif isinstance(value, list) and value and isinstance(value[0], (bytes, bytearray)):
            value = [{"bytes": bytes(v).hex()} for v in value]
        out[name] = value

    record("put", lambda: store.put(k("a"), b"hello"))
    record("put_existing", lambda: store.put(k("a"), b"other"))
    record("get_after_put_existing", lambda: store.get(k("a")))
    record("get_missing", lambda: store.get(k("missing")))
    record("get_size", lambda: store.get_size(k("a")))
    record("get_size_missing", lambda: store.get_size(k("missing")))
    record("is_exist", lambda: store.is_exist(k("a")))
    record("is_exist_missing", lambda: store.is_exist(k("missing")))
    record("batch_is_exist", lambda: store.batch_is_exist([k("a"), k("missing")]))
    record("batch_is_exist_empty", lambda: store.batch_is_exist([]))
    record("upsert", lambda: store.upsert(k("a"), b"newer!"))
    record("get_after_upsert", lambda: store.get(k("a")))
    record("remove", lambda: store.remove(k("a")))
    record("remove_missing", lambda: store.remove(k("a")))
    record("get_after_remove", lambda: store.get(k("a")))

    # Mooncake grants a read lease on every get and lookup, and refuses to remove a leased key (-706) for
    # its lease (5 s by default); keys never read are removed at once there too.
    record("put_unread", lambda: store.put(k("r"), b"x"))
    record("remove_unread", lambda: store.remove(k("r")))
    record("remove_unread_again", lambda: store.remove(k("r")))
    record("put_batch_unread", lambda: store.put_batch([k("r0"), k("r1")], [b"a", b"b"]))
    record("batch_remove_unread", lambda: store.batch_remove([k("r0"), k("missing"), k("r1")]))

    record("put_batch", lambda: store.put_batch([k("b0"), k("b1")], [b"zero", b"one"]))
    record("get_batch", lambda: store.get_batch([k("b0"), k("missing"), k("b1")]))
    record("batch_remove", lambda: store.batch_remove([k("b0"), k("missing"), k("b1")]))

    record("put_parts", lambda: store.put_parts(k("parts"), b"ab", b"cd", b"ef"))
    record("get_parts", lambda: store.get(k("parts")))
    handle = []
    record("get_buffer_size", lambda: (handle.append(store.get_buffer(k("parts"))), handle[0].size())[1])
    record("get_buffer_bytes", lambda: bytes(memoryview(handle[0])))
    record("get_buffer_missing", lambda: store.get_buffer(k("missing")) is None)
    record("batch_get_buffer", lambda: [None if h is None else h.size()
                                        for h in store.batch_get_buffer([k("parts"), k("missing")])])

    region = mmap.mmap(-1, BUFFER)
    region[:256] = bytes(range(256))
    base = _address(region)
    half = BUFFER // 2
    record("register_buffer", lambda: store.register_buffer(base, BUFFER))
    record("put_from", lambda: store.put_from(k("z"), base, 256))
    record("get_into", lambda: store.get_into(k("z"), base + half, 256))
    record("get_into_bytes", lambda: bytes(region[half:half + 256]))
    record("get_into_larger_buffer", lambda: store.get_into(k("z"), base + half, 4096))
    record("get_into_small_buffer", lambda: store.get_into(k("z"), base + half, 16))
    record("get_into_missing", lambda: store.get_into(k("missing"), base + half, 256))
    record("put_from_existing", lambda: store.put_from(k("z"), base, 256))
    region[256:512] = bytes(255 - i for i in range(256))
    record("batch_put_from", lambda: store.batch_put_from([k("z0"), k("z1")], [base, base + 256], [256, 256]))
    record("batch_put_from_existing", lambda: store.batch_put_from([k("z0"), k("z2")], [base, base + 256],
                                                                   [256, 256]))
    record("batch_get_into", lambda: store.batch_get_into([k("z0"), k("missing"), k("z1")],
                                                          [base + half, base + half + 256, base + half + 512],
                                                          [256, 256, 256]))
    record("batch_get_into_bytes", lambda: bytes(region[half:half + 256]) + bytes(region[half + 512:half + 768]))
    record("upsert_from", lambda: store.upsert_from(k("z0"), base + 256, 256))
    record("get_after_upsert_from", lambda: store.get(k("z0"))[:4])
    record("unregister_buffer", lambda: store.unregister_buffer(base))
    record("unregister_buffer_again", lambda: store.unregister_buffer(base))

    record("put_empty_value", lambda: store.put(k("empty"), b""))
    record("put_empty_key", lambda: store.put("", b"x"))
    record("health_check", lambda: store.health_check())
    record("hostname_is_str", lambda: isinstance(store.get_hostname(), str))
    record("remove_all_leaves_nothing", lambda: (store.remove_all(), store.is_exist(k("z1")))[1])
    region.close()
    return out


def main() -> None:
    import argparse

    from mooncake.store import MooncakeDistributedStore

    parser = argparse.ArgumentParser()
    parser.add_argument("--master", required=True)
    parser.add_argument("--metadata", default="http://127.0.0.1:8080/metadata")
    parser.add_argument("--segment-mib", type=int, default=64)
    args = parser.parse_args()
    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", args.metadata, args.segment_mib << 20, 16 << 20, "tcp", "", args.master)
    if rc != 0:
        raise SystemExit(f"setup returned {rc}")
    answers = cases(store, "surface")
    answers["close"] = store.close()
    json.dump(answers, sys.stdout, indent=1, sort_keys=True)
    print()


if __name__ == "__main__":
    main()
