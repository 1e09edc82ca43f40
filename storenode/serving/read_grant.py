"""Whether this node may serve reads: no read returns a version an overwrite or remove has replaced.

The leader frees a replaced version on its nodes before the overwrite returns, unless a node does not
confirm the FREE; then the leader waits until that node has stopped serving reads on its own clock. So a
node serves reads only within READ_GRANT of the last REPORT of the current term it received. Whether its
etcd lease holds does not matter (nodes serve through an etcd outage): a leader that drops a node still
orders FREEs there until that node's grant has surely ended (master/nodes/read_grants.py). Once lapsed it stays
so until the leader has reconciled it: an INVENTORY (the leader first sends the FREEs it still owes the
node, then adopts what the node holds and frees the rest), then a REPORT, which the leader sends only
once every FREE it ordered there is confirmed. Refused reads raise
StaleReplicaError, which makes a client ask the master again and try another replica.
"""

import math
import time

from kvpool.errors import StaleReplicaError
from kvpool.protocol.wire import READ_GRANT


class ReadGrant:
    def __init__(self, period: float = READ_GRANT, clock=time.monotonic):
        self.period = period
        self._clock = clock
        # No leader has taken this node in yet: nothing was freed here to miss. Open until a grant after
        # the first INVENTORY, so a node cut off before its first REPORT stops serving too.
        self.until = math.inf
        self._reconciling = False  # an INVENTORY came since the grant lapsed: the next REPORT renews it

    def lapsed(self) -> bool:
        return self._clock() >= self.until

    def check(self) -> None:
        """StaleReplicaError unless reads may be served now."""
        if self.lapsed():
            raise StaleReplicaError("this node lost contact with the leader and is not reconciled yet; "
                                    "ask the master again")

    def inventoried(self, new_term: bool = False) -> None:
        """An INVENTORY of the current term arrived (`new_term`: the first of a new leader's term, which
        reconciles the node whatever its grant: the new leader knows only what this inventory says, and
        REPORTs only once it owes the node no FREE, so its first REPORT renews the grant even if the
        previous leader's lapsed meanwhile)."""
        if new_term and self.until == math.inf:  # the open start ends a grant after a leader takes the node in
            self.until = self._clock() + self.period
        if new_term or self.lapsed():
            self._reconciling = True

    def reported(self) -> bool:
        """A REPORT of the current term arrived: the grant is renewed unless it lapsed and no INVENTORY
        came since. Returns whether reads are served (the REPORT tells the leader)."""
        if self.lapsed() and not self._reconciling:
            return False
        self._reconciling = False
        self.until = self._clock() + self.period
        return not self.lapsed()
