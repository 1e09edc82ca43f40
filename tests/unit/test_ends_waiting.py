"""Ends that wait (ObjectTable.end_later): a batch of plain ends is answered at once and folded into
the table later, and nothing that reads or changes the table can tell the difference."""

import pytest

from kvpool.errors import KeyExistsError
from kvpool.master.table import objects
from kvpool.master.table.objects import ObjectTable

from test_objects import FakeClock, record, report
from test_put_end_many import _state


def ends_waiting(table: ObjectTable) -> bool:
    """Whether ends kept by end_later are still to be folded (read without folding them)."""
    return bool(table._waiting_ends)


def _table() -> tuple[ObjectTable, FakeClock]:
    clock = FakeClock()
    table = ObjectTable(put_timeout=10.0, clock=clock, first_generation=100)
    table.upsert_node(record("n1"))
    table.upsert_node(record("n2", port=7001))
    return table, clock


def _start(table: ObjectTable, keys: list[str], replicas: int = 1) -> list[int]:
    return [v.generation for v in table.put_start_many(keys, [100] * len(keys), [7] * len(keys), replicas=replicas)]


def test_waiting_ends_fold_into_the_table_that_ending_them_at_once_makes():
    tables = []
    for later in (False, True):
        table, _ = _table()
        keys = [f"k/{i}" for i in range(6)]
        generations = _start(table, keys, replicas=2)
        if later:
            assert table.end_later(keys[:3], generations[:3])
            assert table.end_later(keys[3:], generations[3:])
            assert ends_waiting(table)
        else:
            assert table.put_end_many(keys, generations) == [None] * 6
        tables.append(table)
    at_once, folded = tables
    assert folded.object_count == 6  # a public read folds the waiting ends first
    assert not ends_waiting(folded)
    assert _state(folded) == _state(at_once)


def test_a_waiting_end_is_seen_by_every_reader():
    table, _ = _table()
    generations = _start(table, ["a", "b"])
    assert table.end_later(["a", "b"], generations)
    assert table.exists_many(["a", "x", "b"]) == [True, False, True]
    assert ends_waiting(table)  # a lookup answered without folding
    assert table.lookup("a").generation == generations[0]
    assert not ends_waiting(table)  # any other reader folds first


@pytest.mark.parametrize("read", [
    lambda t: t.object_count,
    lambda t: t.counters.puts,
    lambda t: t.get("a").generation,
    lambda t: t.committed_keys(),
    lambda t: t.objects_on(t.get("a").replicas[0].node_id),
    lambda t: t.remove("a"),
    lambda t: t.put_start("a", 5, 1),
])
def test_every_other_use_of_the_table_folds_the_waiting_ends_first(read):
    table, _ = _table()
    generations = _start(table, ["a"])
    assert table.end_later(["a"], generations)
    try:
        read(table)
    except KeyExistsError:  # the put_start: "a" is there
        pass
    assert not ends_waiting(table)


def test_an_eviction_reported_while_an_end_waits_drops_the_copy_it_names():
    table, _ = _table()
    (generation,) = _start(table, ["a"])
    assert table.end_later(["a"], [generation])
    version_node = table.get("a").replicas[0].node_id
    table.apply_evictions(version_node, "i1", [["a", generation]])
    assert table.exists_many(["a"]) == [False]


@pytest.mark.parametrize("case", ["overwrite", "late", "wrong generation", "never started", "empty"])
def test_an_end_that_is_not_plain_does_not_wait_and_changes_nothing(case):
    table, clock = _table()
    (old,) = _start(table, ["a"])
    table.put_end("a", old)
    keys = ["new", "a" if case == "overwrite" else "other"]
    if case == "empty":
        generations = [_start(table, ["new"])[0], table.put_start("other", 0, 1).generation]
    elif case == "overwrite":
        generations = [_start(table, ["new"])[0], table.put_start("a", 100, 7, overwrite=True).generation]
    else:
        generations = _start(table, keys)
        if case == "late":
            clock.now += 11
        elif case == "wrong generation":
            generations[1] += 1
        elif case == "never started":
            keys[1] = "nobody"
    before = _state(table)
    assert not table.end_later(keys, generations)
    assert not ends_waiting(table)
    assert _state(table) == before


def test_the_methods_that_do_not_fold_are_the_ones_named():
    """A public method added to ObjectTable folds first unless it is named here on purpose."""
    public = {name for name in vars(ObjectTable) if not name.startswith("_")}
    assert objects._READ_THROUGH <= public
    for name in sorted(public - objects._READ_THROUGH):
        attr = getattr(ObjectTable, name)
        assert (attr.fget if isinstance(attr, property) else attr).__code__ is objects._folding(len).__code__, name
