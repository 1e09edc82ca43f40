"""The committed keys as a numbered feed of changes, for subscribers such as KV-aware routers.

While this master leads, every change of which keys are committed gets the next
sequence number in a bounded in-memory log: STORED (a key present that was
absent) or REMOVED (a key gone). A key replaced or re-placed while present (an
overwrite, a new copy, a repair) is no event: a router cares which keys exist,
not where or which version. Changes come from the object table's change
tracking, taken every POLL_INTERVAL, so a key stored and removed between two
takes is no event either.

A subscriber resumes with (feed id, last sequence seen). While that sequence is
still in the log it goes on from there; otherwise (another feed, i.e. another
term or master, or it fell more than `size` changes behind) it starts again from
a snapshot of the present keys, which is consistent with the sequence it is
taken at. The feed lives for one term at most: it opens, with a fresh id, when
the first subscriber of the term comes (until then no change is tracked: a
cluster with no router pays nothing for it), and closes when its master stops
leading.
"""

import asyncio
import logging
import secrets

from kvpool.master.leadership.election import LeadershipState

log = logging.getLogger(__name__)

STORED, REMOVED = "stored", "removed"
DEFAULT_SIZE = 100_000  # changes kept: what a subscriber may lag by and still resume without a snapshot
POLL_INTERVAL = 0.01    # how often the table's changes are taken (the latency a subscriber sees)
SCAN_LIMIT = 10_000     # log entries one since() call looks at, so one call never blocks the loop long


class FeedClosed(Exception):
    """The feed a subscriber followed ended (its master stopped leading)."""


class KeyFeed:
    def __init__(self, table, size: int = DEFAULT_SIZE, poll_interval: float = POLL_INTERVAL):
        if size < 1:
            raise ValueError(f"a key feed keeps at least one change, got {size}")
        self._table = table
        self.size = size
        self._poll_interval = poll_interval
        self.id = ""  # "" while closed; "<term>-<random>" while open
        self.sequence = 0  # the last sequence handed out
        self._log: list = []  # ring of (kind, key): sequence s at index s % size
        self._advanced = asyncio.Event()  # set and replaced whenever the sequence moves or the feed closes
        self._leading_term = 0  # the term this master serves as leader in (0: it does not lead)

    # ----- life -----

    def open(self, term: int) -> None:
        """Start a feed for `term`: the table is followed from now on (a snapshot covers what came before)."""
        self.close()
        self._table.track_changes(True)
        self._table.take_appeared_and_gone()  # anything marked before is in every snapshot from now on
        self.id = f"{term}-{secrets.token_hex(8)}"
        self.sequence = 0
        self._log = [None] * self.size
        log.info("key feed %s open (keeps %d changes)", self.id, self.size)

    def close(self) -> None:
        """End the feed: its subscribers see FeedClosed; the table is no longer followed."""
        if not self.id:
            return
        self.id = ""
        self._log = []
        self._table.track_changes(False)
        self._wake()

    def open_for_subscriber(self) -> str:
        """The feed's id, opening it for the term this master leads in if it is not open yet; "" when
        this master does not lead."""
        if not self.id and self._leading_term:
            self.open(self._leading_term)
        return self.id

    async def run(self, election: LeadershipState) -> None:
        """Follow the table, once a subscriber opened the feed, while `election` says this master
        serves as leader (a feed belongs to one term)."""
        try:
            while True:
                term = self._leading_term = election.term if election.serving and election.is_leader else 0
                if self.id and not self.id.startswith(f"{term}-"):
                    self.close()
                else:
                    self.poll()
                await asyncio.sleep(self._poll_interval)
        finally:
            self._leading_term = 0
            self.close()

    # ----- the log -----

    def poll(self) -> int:
        """Number the changes made since the last poll; returns how many."""
        if not self.id or not self._table.has_changes:
            return 0
        stored, removed = self._table.take_appeared_and_gone()
        sequence, log, size = self.sequence, self._log, self.size
        for kind, keys in ((STORED, stored), (REMOVED, removed)):
            for key in keys:
                sequence += 1
                log[sequence % size] = (kind, key)
        self.sequence = sequence
        if stored or removed:
            self._wake()
        return len(stored) + len(removed)

    def _wake(self) -> None:
        self._advanced.set()
        self._advanced = asyncio.Event()

    def snapshot(self, prefix: str) -> tuple[int, list[str]]:
        """(sequence, every committed key with `prefix` as of that sequence)."""
        self._check_open()
        self.poll()  # the table now matches the log up to self.sequence
        return self.sequence, self._table.committed_keys(prefix)

    def can_resume(self, feed_id: str, after: int) -> bool:
        """Whether a subscriber at (feed_id, after) can go on from the log, without a snapshot (judged
        with every change committed so far numbered, so none it could not have heard of is skipped)."""
        self.poll()
        return bool(self.id) and feed_id == self.id and self.sequence - self.size <= after <= self.sequence

    def since(self, after: int, prefix: str, limit: int) -> tuple[list[tuple[str, str]], int] | None:
        """Up to `limit` changes of keys with `prefix` after sequence `after`, and the sequence they bring
        the subscriber to (later than the last change when others were skipped); None when `after` is no
        longer in the log (the subscriber needs a snapshot)."""
        self._check_open()
        if not self.sequence - self.size <= after <= self.sequence:
            return None
        changes = []
        at, end = after, min(self.sequence, after + SCAN_LIMIT)
        while at < end and len(changes) < limit:
            at += 1
            kind, key = self._log[at % self.size]
            if key.startswith(prefix):
                changes.append((kind, key))
        return changes, at

    async def wait(self, after: int, timeout: float) -> None:
        """Until the sequence moves past `after`, the feed closes, or `timeout` passes."""
        if self.sequence > after or not self.id:
            return
        try:
            await asyncio.wait_for(self._advanced.wait(), timeout)
        except TimeoutError:
            pass

    def _check_open(self) -> None:
        if not self.id:
            raise FeedClosed("the key feed is closed: this master does not lead")
