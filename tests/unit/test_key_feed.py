"""The key feed's logic on a real object table: which changes are events, the bounded log, resume or snapshot."""

import pytest
from kvpool.master.table.change_tracking import ChangeTrackingDict
from kvpool.master.serving.key_feed import REMOVED, STORED, FeedClosed, KeyFeed
from kvpool.master.table.objects import ObjectTable

from kvpool.protocol.cluster_layout import NodeRecord, TierRecord
from async_wait import until


def table_with_nodes() -> ObjectTable:
    table = ObjectTable(first_generation=1)
    for i in (1, 2):
        table.upsert_node(NodeRecord(f"n{i}", f"n{i}-i1", "127.0.0.1", 9000 + i,
                                     tiers={"dram": TierRecord(1 << 30)}))
    return table


def put(table: ObjectTable, key: str, **kw) -> None:
    version = table.put_start(key, 10, 1, **kw)
    table.put_end(key, version.generation)


def drain(feed: KeyFeed, after: int, prefix: str = "") -> list[tuple[str, str]]:
    changes, upto = feed.since(after, prefix, limit=10_000)
    assert upto == feed.sequence
    return changes


def test_the_dict_tells_appeared_and_gone_from_replaced():
    d = ChangeTrackingDict()
    d["old"] = 1
    d.take_appeared_and_gone()
    d["new"] = 1
    d["old"] = 2          # replaced: neither
    d["flash"] = 1
    del d["flash"]        # came and went between two takes: neither
    assert d.take_appeared_and_gone() == (["new"], [])
    d.pop("old")
    d["back"] = 1
    del d["back"]
    d["back"] = 2
    assert d.take_appeared_and_gone() == (["back"], ["old"])
    assert not d.has_changes


def test_stored_and_removed_are_numbered_and_an_overwrite_or_new_copy_is_no_event():
    table = table_with_nodes()
    feed = KeyFeed(table, size=100)
    feed.open(term=7)
    assert feed.id.startswith("7-")
    put(table, "a/1")
    feed.poll()
    put(table, "a/1", overwrite=True)  # replaced while present
    version = table.lookup("a/1")
    assert table.add_replica("a/1", version.generation, "n2" if version.replicas[0].node_id == "n1" else "n1",
                             "dram")
    put(table, "b/1")
    feed.poll()
    table.remove("a/1")
    feed.poll()
    assert feed.sequence == 3
    assert drain(feed, 0) == [(STORED, "a/1"), (STORED, "b/1"), (REMOVED, "a/1")]
    assert drain(feed, 0, prefix="a/") == [(STORED, "a/1"), (REMOVED, "a/1")]
    assert drain(feed, 3) == []


def test_a_snapshot_matches_the_log_at_its_sequence():
    table = table_with_nodes()
    put(table, "before")  # committed before the feed: only a snapshot shows it
    feed = KeyFeed(table, size=100)
    feed.open(term=1)
    assert feed.snapshot("") == (0, ["before"])
    put(table, "x/1")
    put(table, "y/1")
    sequence, keys = feed.snapshot("x/")  # takes the pending changes first
    assert sequence == 2 and keys == ["x/1"]


def test_resume_only_within_the_log_of_the_same_feed():
    table = table_with_nodes()
    feed = KeyFeed(table, size=4)
    feed.open(term=1)
    for i in range(6):
        put(table, f"k{i}")
        feed.poll()
    assert feed.sequence == 6
    assert feed.can_resume(feed.id, 2) and feed.can_resume(feed.id, 6)
    assert not feed.can_resume(feed.id, 1)  # fell out of the log: a snapshot instead
    assert feed.since(1, "", 10) is None
    assert drain(feed, 2) == [(STORED, f"k{i}") for i in range(2, 6)]
    assert not feed.can_resume(feed.id, 7)  # a position this feed never gave
    assert not feed.can_resume("1-other", 4)
    old = feed.id
    feed.open(term=2)  # a new term is a new feed: every old position needs a snapshot
    assert feed.id != old and not feed.can_resume(old, 6) and feed.sequence == 0


def test_since_is_bounded_and_moves_past_keys_of_other_prefixes():
    table = table_with_nodes()
    feed = KeyFeed(table, size=100)
    feed.open(term=1)
    for i in range(5):
        put(table, f"other/{i}")
    put(table, "mine/1")
    feed.poll()
    changes, upto = feed.since(0, "mine/", limit=10)
    assert changes == [(STORED, "mine/1")] and upto == 6
    changes, upto = feed.since(0, "", limit=2)
    assert len(changes) == 2 and upto == 2


def test_a_closed_feed_stops_following_the_table():
    table = table_with_nodes()
    feed = KeyFeed(table, size=10)
    feed.open(term=1)
    feed.close()
    put(table, "k")
    assert not table.has_changes  # nobody follows: nothing is kept
    with pytest.raises(FeedClosed):
        feed.snapshot("")
    assert not feed.can_resume("", 0)


class _Leadership:
    """What KeyFeed.run reads of master/leadership/election.py's LeadershipState."""

    def __init__(self, term: int):
        self.term, self.serving, self.is_leader = term, True, True


def test_a_leader_follows_the_table_only_once_a_subscriber_opened_its_feed():
    import asyncio

    async def scenario():
        table = table_with_nodes()
        feed = KeyFeed(table, size=100, poll_interval=0.005)
        leadership = _Leadership(term=7)
        polls, poll = [0], feed.poll
        feed.poll = lambda: (polls.__setitem__(0, polls[0] + 1), poll())[1]  # counts the feed's turns
        runner = asyncio.create_task(feed.run(leadership))
        await until(lambda: feed.open_for_subscriber() != "")
        put(table, "a")
        await until(lambda: feed.sequence == 1)  # followed once opened
        assert feed.id.startswith("7-")
        leadership.term = 8  # a new term: that feed ends; the next subscriber opens one of its own
        await until(lambda: not feed.id)
        turns = polls[0]
        await until(lambda: polls[0] >= turns + 3)  # the feed went round a few times in the new term
        put(table, "b")
        assert not table.has_changes  # nobody subscribed this term: nothing tracked
        assert feed.open_for_subscriber().startswith("8-")
        leadership.is_leader = False
        await until(lambda: not feed.id)
        assert feed.open_for_subscriber() == ""  # a follower has no feed to give
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner

    table = table_with_nodes()
    feed = KeyFeed(table, size=100)
    put(table, "before")
    assert feed.open_for_subscriber() == "" and not table.has_changes  # not leading yet: nothing opened
    asyncio.run(scenario())
