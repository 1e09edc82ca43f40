"""A batch of PutEnds (ObjectTable.put_end_many, a BatchPutEnd's keys column) ends each put exactly as
put_end would: same answers, same table afterwards, whatever state each put is in."""

import pytest

from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.versions import DRAM

from test_objects import FakeClock, record, report


def _scenario(table: ObjectTable, clock: FakeClock) -> list:
    """Puts in every state an end can meet; returns the (key, generation) pairs to end, in order."""
    table.upsert_node(record("n2", port=7001))
    ends = []
    for i in range(3):  # plain puts, the common case
        ends.append((f"plain/{i}", table.put_start(f"plain/{i}", 100 + i, 1).generation))
    ends.append(("both", table.put_start("both", 100, 1, replicas=2).generation))
    wrong = table.put_start("wrong", 100, 1)
    ends.append(("wrong", wrong.generation + 1))  # not the pending generation
    ends.append(("never", 12345))  # never started
    empty = table.put_start("empty", 0, 1)
    ends.append(("empty", empty.generation))
    evicted = table.put_start("evicted", 100, 1)
    node = evicted.replicas[0].node_id
    table.apply_report(node, "i1", report(evicted=[("evicted", evicted.generation)]), table.report_mark())
    ends.append(("evicted", evicted.generation))
    draining = table.put_start("draining", 100, 1, replicas=2)
    ends.append(("draining", draining.generation))
    late = table.put_start("late", 100, 1)
    old = table.put_start("again", 100, 1)
    table.put_end("again", old.generation)
    ends.append(("again", old.generation))  # already committed: answered with the committed version
    clock.now += 5
    ends.insert(0, ("late", late.generation))
    for i in range(3):  # placed after `late`, so still in time when it is not
        key = f"fresh/{i}"
        ends.append((key, table.put_start(key, 50, 1).generation))
    clock.now += 6  # `late` and everything started before it are past the 10 s put timeout now...
    return ends


def _state(table: ObjectTable) -> tuple:
    committed = {key: table.lookup(key) for key in table._ledger.committed}
    return (committed, table.pending_count, dict(vars(table.counters)), set(table.repair_keys),
            {n: (node.reserved(DRAM), sorted(node.keys)) for n, node in table.nodes.items()},
            sorted(f.generation for f in table.take_frees()))


def _outcome(result) -> str:
    return "ok" if result is None else f"{type(result).__name__}: {result}"


@pytest.mark.parametrize("restart_clock", [False, True])
def test_a_batch_of_ends_does_what_the_ends_one_by_one_do(restart_clock):
    tables = []
    for _ in range(2):
        clock = FakeClock()
        table = ObjectTable(put_timeout=10.0, clock=clock, first_generation=100)
        table.upsert_node(record("n1"))
        ends = _scenario(table, clock)
        if restart_clock:  # ...unless the clock is put back: every put still in time
            clock.now -= 6
        tables.append((table, ends))
    (one_by_one, ends), (batched, same_ends) = tables
    assert ends == same_ends
    for table in (one_by_one, batched):
        table.start_drain("n2")
    singles = []
    for key, generation in ends:
        try:
            one_by_one.put_end(key, generation)
        except Exception as exc:  # noqa: BLE001 - compared below
            singles.append(exc)
        else:
            singles.append(None)
    many = batched.put_end_many([k for k, _ in ends], [g for _, g in ends])
    assert [_outcome(r) for r in many] == [_outcome(r) for r in singles]
    assert _state(batched) == _state(one_by_one)
    assert any(r is None for r in many) and any(r is not None for r in many)
    assert batched.repair_keys  # a put with a copy on the draining node is due a repair
