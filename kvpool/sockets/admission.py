"""Which accepted connections a listening server keeps: slots for peers that proved a credential, and a
separate small pool for those still in their handshake, so strangers can never take the proved ones' slots.

Pure bookkeeping, no I/O: the server (storenode/serving/tcp_server.py, master/serving/control_port.py, kvpool/runtime/health.py)
asks admit() on accept, prove() when the peer's credential holds, forget() when the connection ends, and
closes what admit() displaced.

When the unproved pool is full, a new connection displaces the OLDEST unproved one instead of being refused.
Refusing the newest would let a flood hold every unproved slot for a whole handshake deadline and refuse the
honest peers that come meanwhile (on loopback in tests, or behind one NAT, the flood and the honest client even
share an address). Displacing the oldest means a flood only churns itself: an honest handshake takes one round
trip (milliseconds), and is displaced only if the pool's worth of new connections arrive within that round trip;
a flood opened and held, as the connections that would exhaust descriptors are, is pushed out by the next honest
connection. The per-address cap keeps a flood from one address from displacing the handshakes of other
addresses: past it, a new connection displaces the oldest of its own address.
"""

from collections import OrderedDict
from typing import Hashable

UNPROVED = 256  # connections in their handshake at once, all peers together
UNPROVED_PER_ADDRESS = 32  # of them from one peer address


class Admission:
    """limit: proved connections served at once (past it a new connection is turned away: it could not be
    served even if it proved its credential); unproved: connections still in their handshake;
    per_address: of those, from one peer address."""

    def __init__(self, limit: int, unproved: int = UNPROVED, per_address: int = UNPROVED_PER_ADDRESS):
        if limit < 1 or unproved < 1 or per_address < 1:
            raise ValueError("connection caps must be at least 1")
        self.limit = limit
        self.unproved_limit = unproved
        self.per_address = min(per_address, unproved)
        self.proved: set[Hashable] = set()
        self._unproved: OrderedDict[Hashable, str] = OrderedDict()  # connection -> peer address, oldest first
        self._by_address: dict[str, OrderedDict[Hashable, None]] = {}
        self.displaced = 0  # unproved connections pushed out by newer ones, ever

    @property
    def full(self) -> bool:
        """Every proved slot is taken: a new connection could not be served even if it proved itself."""
        return len(self.proved) >= self.limit

    @property
    def unproved(self) -> int:
        return len(self._unproved)

    def admit(self, connection: Hashable, address: str) -> tuple[bool, list]:
        """Take a just-accepted connection from `address` as unproved: (True, the connections it displaced,
        for the caller to close), or (False, []) when every proved slot is taken."""
        if self.full:
            return False, []
        displaced = []
        same = self._by_address.get(address)
        if same is not None and len(same) >= self.per_address:
            displaced.append(next(iter(same)))
        elif len(self._unproved) >= self.unproved_limit:
            displaced.append(next(iter(self._unproved)))
        for old in displaced:
            self.forget(old)
        self.displaced += len(displaced)
        self._unproved[connection] = address
        self._by_address.setdefault(address, OrderedDict())[connection] = None
        return True, displaced

    def prove(self, connection: Hashable) -> bool:
        """The connection's peer proved its credential: it moves to a proved slot. False when none is free
        (the caller turns it away) or it was displaced meanwhile."""
        if connection not in self._unproved:
            return connection in self.proved
        self.forget(connection)
        if len(self.proved) >= self.limit:
            return False
        self.proved.add(connection)
        return True

    def forget(self, connection: Hashable) -> None:
        """The connection ended (or was displaced): its slot is free."""
        self.proved.discard(connection)
        address = self._unproved.pop(connection, None)
        if address is not None:
            same = self._by_address[address]
            del same[connection]
            if not same:
                del self._by_address[address]
