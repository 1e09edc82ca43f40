"""What the leader knows of each node's read grant (storenode/serving/read_grant.py), and the FREEs it owes.

A node serves reads within READ_GRANT of the last REPORT it received. Every FREE the leader orders stays
owed to its node until the node confirms it (freed, or not held); the leader REPORTs to a node only once
it owes it nothing, so no REPORT renews a grant over a version that should be gone. When a node does not
confirm a FREE an overwrite or remove caused, the request returns only once the node's grant has surely
ended (`grant_ends`): the node then refuses reads until the leader reconciled it.

The bound: a REPORT answered at t reached the node before t, so its grant ends before t + READ_GRANT.
A REPORT with no answer (failed, or still out) may reach the node later: if before the FREE was sent, the
grant ends before that + READ_GRANT; if after, the FREE is right behind it on the same connection. And a
node whose grant lapsed is not renewed by it (it waits for an INVENTORY first), so the grant also ends
within 2 READ_GRANT of the last answered REPORT. REPORTs go out one at a time per node, and after an
unanswered one no other until the node was reconciled (NodeIO.report, whoever asks), so there is at most
one such REPORT. A node the leader stopped REPORTing is adopted again only once its grant has surely ended
(until_ended); one dropped from the table meanwhile is still freed on until then (Ledger.still_serving).
"""

import asyncio
import math
import time

from kvpool.errors import KeyNotFoundError
from kvpool.net.netutil import SILENT_PEER_SECONDS
from kvpool.protocol.wire import READ_GRANT

from kvpool.master.table.ledger import FreeOrder

RATE_MARGIN = 1.05  # clocks of two hosts may run at slightly different rates
SLACK = 0.05


class ReadGrants:
    def __init__(self, clock=time.monotonic, period: float = READ_GRANT, delivery: float = SILENT_PEER_SECONDS):
        self._clock = clock
        self.period = period
        self.delivery = delivery  # a REPORT not delivered this long after it was sent never is (netutil.long_lived)
        self._sent: dict[str, float] = {}  # address -> when its last REPORT was sent
        self._owed: dict[str, dict[tuple[bytes, int], FreeOrder]] = {}
        self._answered: dict[str, float] = {}  # address -> when its last REPORT was answered
        self._unanswered: set[str] = set()  # addresses with a REPORT out and no answer (yet)
        self._silent: set[str] = set()  # addresses that left a REPORT unanswered and were not reconciled since
        self._reporting: dict[str, asyncio.Lock] = {}  # one REPORT at a time per node

    # ----- FREEs

    def ordered(self, orders) -> None:
        for order in orders:
            self._owed.setdefault(order.address, {})[(order.key, order.generation)] = order

    def answered(self, address: str, orders, results) -> bool:
        """The node answered `orders` with `results` (one each); True if it confirmed them all
        (freed, or not held). Confirmed orders are owed no longer."""
        owed = self._owed.get(address)
        every = True
        for order, result in zip(orders, results):
            if isinstance(result, BaseException) and not isinstance(result, KeyNotFoundError):
                every = False
            elif owed is not None:
                owed.pop((order.key, order.generation), None)
        if owed is not None and not owed:
            del self._owed[address]
        return every

    def owed(self, address: str) -> list[FreeOrder]:
        return list(self._owed.get(address, {}).values())

    # ----- REPORTs

    def report_sent(self, address: str) -> None:
        self._unanswered.add(address)
        self._sent[address] = self._clock()

    def reporting(self, address: str) -> asyncio.Lock:
        lock = self._reporting.get(address)
        if lock is None:
            lock = self._reporting[address] = asyncio.Lock()
        return lock

    def may_report(self, address: str) -> bool:
        return address not in self._silent

    def report_unanswered(self, address: str) -> None:
        """A REPORT got no answer (it may still reach the node): no other until it is reconciled."""
        self._silent.add(address)

    def reconciled(self, address: str) -> None:
        """The node's inventory was adopted again after its owed FREEs were confirmed: REPORTs resume."""
        self._silent.discard(address)

    def report_answered(self, address: str) -> None:
        self._answered[address] = self._clock()
        self._unanswered.discard(address)

    def grant_ends(self, address: str, freed_at: float) -> float:
        """When the node at `address` surely stops serving reads (this clock), for a FREE sent at
        `freed_at` that it did not confirm."""
        answered = self._answered.get(address)
        period = self.period * RATE_MARGIN + SLACK
        if answered is None:  # never reported by this leader: its grant is an older leader's
            return freed_at + period
        if address in self._unanswered:
            return min(answered + 2 * period, freed_at + period)
        return answered + period

    async def until_ended(self, address: str) -> None:
        """Return once the grant REPORTs of this leader gave the node at `address` has surely ended
        (at once if none was given)."""
        if address not in self._answered and address not in self._unanswered:
            return
        while True:
            if address in self._answered:  # one grant past the last answered REPORT, two with one unanswered
                ends = self.grant_ends(address, math.inf)
            else:  # never answered: the REPORT out reached the node within `delivery` of its sending, or never
                ends = self._sent[address] + self.delivery + self.period * RATE_MARGIN + SLACK
            left = ends - self._clock()
            if left <= 0:
                return
            await asyncio.sleep(left)  # asked again after: a REPORT answered meanwhile moves the end
