from kvpool.master.tally import PendingBytes, Unreported


def test_pending_bytes_keep_per_tier_totals():
    pending = PendingBytes()
    pending[1] = ("dram", 100)
    pending[2] = ("ssd", 7)
    pending[3] = ("dram", 50)
    pending[1] = ("dram", 10)  # replaced, not added
    assert (pending.by_tier["dram"], pending.by_tier["ssd"]) == (60, 7)
    assert pending.pop(3) == ("dram", 50)
    assert pending.pop(99, None) is None
    del pending[2]
    assert (pending.by_tier["dram"], pending.by_tier["ssd"], len(pending)) == (10, 0, 1)


def test_unreported_drops_through_a_report_mark():
    unreported = Unreported()
    for seq, tier, size in [(1, "dram", 10), (2, "ssd", 20), (5, "dram", 30)]:
        unreported.append((seq, tier, size))
    unreported.drop_through(2)
    assert list(unreported) == [(5, "dram", 30)]
    assert (unreported.bytes_by_tier["dram"], unreported.count_by_tier["dram"]) == (30, 1)
    assert (unreported.bytes_by_tier["ssd"], unreported.count_by_tier["ssd"]) == (0, 0)
    unreported.drop_through(9)
    assert not unreported and unreported.bytes_by_tier["dram"] == 0
