"""The register check's arithmetic (register_check.py), on made-up events: what counts as stale, lost, wrong."""

from register_check import acknowledged_before, make_value, read_value, summarize


def _put(key, version, t0, t1, ok=True):
    return {"op": "put", "key": key, "version": version, "t0": t0, "t1": t1, "ok": ok, "error": None if ok else "X"}


def _get(key, version, t0, t1=None, error=None):
    return {"op": "get", "key": key, "version": version, "wrong": False, "t0": t0, "t1": t1 or t0 + 0.01,
            "ok": error is None, "error": error}


def test_a_value_names_its_key_and_version_and_any_changed_byte_is_caught():
    value = make_value("k", 7, 1000)
    assert len(value) == 1000 and read_value("k", value) == 7
    assert read_value("other", value) is None  # another key's bytes
    flipped = bytearray(value)
    flipped[500] ^= 1
    assert read_value("k", bytes(flipped)) is None
    assert read_value("k", value[:-1]) is None


def test_a_read_is_stale_only_below_a_version_acknowledged_before_it_began():
    events = [_put("k", 1, 0.0, 1.0), _put("k", 2, 2.0, 3.0),
              _get("k", 1, 2.5),                      # version 2 not yet acknowledged: fine
              _get("k", 1, 3.5),                      # 2 acknowledged at 3.0: stale
              _get("k", None, 4.0, error="KeyNotFoundError"),  # gone after an ack: missing
              _get("k", 2, 4.5)]
    acks = {"k": ([1.0, 3.0], [1, 2])}
    assert acknowledged_before(acks, "k", 2.9) == 1 and acknowledged_before(acks, "k", 3.1) == 2
    figures = summarize(events, final={"k": 2}, cut=2.0, heal=4.0)
    assert figures["stale_reads"] == 1 and figures["missing_reads"] == 1
    assert figures["acknowledged_puts_lost"] == 0 and figures["failed_calls"] == 0
    assert figures["longest_call_s"] == 1.0
    assert figures["first_put_after_cut_s"] == 1.0 and figures["first_put_after_heal_s"] is None
    assert figures["longest_put_gap"] == {"s": 2.0, "from": -1.0}  # no put returned from 1.0 to 3.0


def test_an_acknowledged_put_is_lost_when_the_key_ends_below_it_and_failures_are_counted():
    events = [_put("a", 1, 0.0, 0.1), _put("a", 2, 0.2, 0.3), _put("a", 3, 0.4, 9.0, ok=False),
              _put("b", 1, 0.0, 0.1)]
    figures = summarize(events, final={"a": 1, "b": 1})
    assert figures["acknowledged_puts_lost"] == 1 and figures["lost_examples"] == {"a": (1, 2)}
    assert figures["failed_calls"] == 1 and figures["errors"] == {"X": 1}
    assert summarize(events, final={"a": 2, "b": None})["acknowledged_puts_lost"] == 1
