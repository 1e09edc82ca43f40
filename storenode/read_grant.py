"""Whether this node may serve reads: no read returns a version an overwrite or remove has replaced.

The leader frees a replaced version on its nodes before the overwrite returns, unless a node does not
confirm the FREE; then the leader waits until that node has stopped serving reads on its own clock. So a
node serves reads only within READ_GRANT of the last REPORT of the current term it received, and only
while its etcd lease cannot have expired (past that the leader may have dropped it and stopped freeing
there). Once lapsed it stays so until the leader has reconciled it: an INVENTORY (the leader first sends
the FREEs it still owes the node, then adopts what the node holds and frees the rest), then a REPORT,
which the leader sends only once every FREE it ordered there is confirmed. Refused reads raise
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
        self.until = math.inf  # no leader has reported yet: nothing was freed here to miss
        self._registration = None  # storenode/registration.py NodeRegistration, once registered
        self._lease: int | None = None  # the lease under which the grant was given
        self._reconciling = False  # an INVENTORY came since the grant lapsed: the next REPORT renews it

    def registered(self, registration) -> None:
        self._registration = registration
        self._lease = registration.lease_id

    def lapsed(self) -> bool:
        if self._clock() >= self.until:
            return True
        registration = self._registration
        if registration is not None and (registration.lease_id != self._lease or not registration.in_etcd()):
            self.until = -math.inf  # the leader may have dropped this node: reconcile before serving again
            return True
        return False

    def check(self) -> None:
        """StaleReplicaError unless reads may be served now."""
        if self.lapsed():
            raise StaleReplicaError("this node lost contact with the leader and is not reconciled yet; "
                                    "ask the master again")

    def inventoried(self) -> None:
        """An INVENTORY of the current term arrived."""
        if self.lapsed():
            self._reconciling = True

    def reported(self) -> bool:
        """A REPORT of the current term arrived: the grant is renewed unless it lapsed and no INVENTORY
        came since. Returns whether reads are served (the REPORT tells the leader)."""
        if self.lapsed() and not self._reconciling:
            return False
        self._reconciling = False
        if self._registration is not None:
            self._lease = self._registration.lease_id
        self.until = self._clock() + self.period
        return not self.lapsed()
