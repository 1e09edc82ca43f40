"""A register check over kvpool keys: writers overwrite each key with increasing versions, readers record what
they read, and the record says whether any acknowledged put was lost, any read got wrong bytes or a version
older than one acknowledged before the read began (stale), or no value at all (missing).

A value carries its key, its version and a digest of the whole, so a reader checks it without knowing what
was written: the bytes are right if the digest matches and the key is the one asked for.
Events are dicts, one per call, written as JSON lines by the workers (host_agent.py):
  {"op": "put", "key", "version", "t0", "t1", "ok", "error"}   t0/t1: time.monotonic() at call and return
  {"op": "get", "key", "version" (None if absent), "wrong", "t0", "t1", "ok", "error"}
time.monotonic() is one clock for every process of the machine (no time namespaces), whatever network
namespace they run in.
"""

import bisect
import hashlib
import json
import os
import struct
from pathlib import Path

_HEADER = struct.Struct("!4sQH")  # magic, version, key length; then the key, the payload, the digest
_MAGIC = b"REG1"
_DIGEST = 16


def read_events(paths) -> list:
    """Every event the workers wrote to `paths` so far (a file not there yet has none)."""
    events = []
    for path in paths:
        if Path(path).exists():
            with open(path) as f:
                events.extend(json.loads(line) for line in f if line.strip())
    return events


def served(path, op: str) -> bool:
    """Whether the worker writing `path` has had a call of `op` succeed."""
    return any(e["op"] == op and e["ok"] for e in read_events([path]))


def make_value(key: str, version: int, size: int) -> bytes:
    """A value of at least `size` bytes for (key, version): header, random payload, digest of all before it."""
    name = key.encode()
    head = _HEADER.pack(_MAGIC, version, len(name)) + name
    body = head + os.urandom(max(0, size - len(head) - _DIGEST))
    return body + hashlib.blake2b(body, digest_size=_DIGEST).digest()


def read_value(key: str, value: bytes) -> int | None:
    """The version `value` holds for `key`, or None when its bytes are wrong (torn, mixed up, another key's)."""
    if len(value) < _HEADER.size + _DIGEST:
        return None
    body, digest = value[:-_DIGEST], value[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        return None
    magic, version, name_len = _HEADER.unpack_from(body)
    if magic != _MAGIC or body[_HEADER.size:_HEADER.size + name_len] != key.encode():
        return None
    return version


def _acks(events: list) -> dict:
    """key -> (sorted ack times, version acknowledged by each): versions only grow per key, so the latest
    acknowledged before a moment is the one at the last ack time before it."""
    per_key: dict = {}
    for e in sorted((e for e in events if e["op"] == "put" and e["ok"]), key=lambda e: e["t1"]):
        times, versions = per_key.setdefault(e["key"], ([], []))
        times.append(e["t1"])
        versions.append(max(e["version"], versions[-1] if versions else 0))
    return per_key


def acknowledged_before(acks: dict, key: str, moment: float) -> int:
    """The highest version of `key` whose put returned before `moment` (0: none)."""
    times, versions = acks.get(key, ([], []))
    i = bisect.bisect_left(times, moment)
    return versions[i - 1] if i else 0


def first_ok_after(events: list, op: str, moment: float | None) -> float | None:
    """Seconds from `moment` until the first `op` started after it succeeded (None: none did)."""
    if moment is None:
        return None
    ends = [e["t1"] for e in events if e["op"] == op and e["ok"] and e["t0"] >= moment]
    return round(min(ends) - moment, 3) if ends else None


def longest_put_gap(events: list, since: float | None = None) -> dict | None:
    """The longest time with no put returning successfully (from `since`, relative to it): {"s", "from"}."""
    ends = sorted(e["t1"] for e in events if e["op"] == "put" and e["ok"])
    if len(ends) < 2:
        return None
    gap, start = max((b - a, a) for a, b in zip(ends, ends[1:]))
    return {"s": round(gap, 3), "from": round(start - (since or 0.0), 3)}


def summarize(events: list, final: dict, cut: float | None = None, heal: float | None = None) -> dict:
    """The figures of one run. `final`: key -> version read after everything settled (None: absent or
    unreadable), from a fresh client; an acknowledged put is lost if its key ends below its version."""
    acks = _acks(events)
    stale, missing = [], []  # reads of an older version; "no such key" after a put of it had returned
    for e in events:
        if e["op"] != "get" or e.get("wrong"):
            continue
        if e["ok"] or e.get("error") == "KeyNotFoundError":
            expected = acknowledged_before(acks, e["key"], e["t0"])
            if (e.get("version") or 0) < expected:
                (stale if e["ok"] else missing).append({
                    "key": e["key"], "read": e.get("version"), "acknowledged": expected,
                    "at": round(e["t0"] - cut, 3) if cut is not None else e["t0"]})
    last_ack = {key: versions[-1] for key, (_, versions) in acks.items()}
    lost = {key: (final.get(key), version) for key, version in last_ack.items() if (final.get(key) or 0) < version}
    calls = [e for e in events if e["op"] in ("put", "get")]
    longest = max(calls, key=lambda e: e["t1"] - e["t0"], default=None)
    errors: dict = {}
    for e in calls:
        if not e["ok"] and e.get("error") != "KeyNotFoundError":
            errors[e["error"]] = errors.get(e["error"], 0) + 1
    return {
        "puts": sum(e["op"] == "put" for e in events),
        "gets": sum(e["op"] == "get" for e in events),
        "longest_call_s": round(longest["t1"] - longest["t0"], 3) if longest else None,
        "longest_call": f"{longest['op']} {longest['key']}" if longest else None,
        "failed_calls": sum(errors.values()),
        "errors": errors,
        "acknowledged_puts_lost": len(lost),
        "lost_examples": dict(list(lost.items())[:3]),
        "wrong_bytes": sum(bool(e.get("wrong")) for e in events),
        "stale_reads": len(stale),
        "stale_examples": stale[:3],
        "missing_reads": len(missing),
        "missing_examples": missing[:3],
        "first_put_after_cut_s": first_ok_after(events, "put", cut),
        "first_put_after_heal_s": first_ok_after(events, "put", heal),
        "longest_put_gap": longest_put_gap(events, cut),
        "first_put_after_cut_s_by_writer": {
            who: first_ok_after([e for e in events if e.get("who") == who], "put", cut)
            for who in sorted({e["who"] for e in events if e["op"] == "put" and "who" in e})},
    }
