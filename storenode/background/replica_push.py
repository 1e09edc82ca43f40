"""COPY: push one object this node holds to another node (the master's replica repair).

The bytes go node to node, never through the master: the holding node WRITEs
them to the destination over the ordinary data protocol, with the object's own
checksum (the destination verifies it again) and what is left of its options,
so the copy is indistinguishable from one the client wrote.
"""

import asyncio

from kvpool.errors import InvalidArgumentError, KeyNotFoundError, StaleReplicaError, UnavailableError
from kvpool.net.tcp_link import TcpLink
from kvpool.protocol.write_options import WriteOptions

from kvpool.storenode.storage.store import ObjectStore

COPY_TIMEOUT = 60.0  # a destination that stops reading must not hold the object's reference forever


class Copier:
    def __init__(self, store: ObjectStore, credential=None, tls=None, timeout: float = COPY_TIMEOUT):
        self.store = store
        self.credential = credential
        self.tls = tls  # a client ssl context when the cluster runs TLS
        self.timeout = timeout
        self._transport = None  # one outbound connection per destination, made on the first COPY

    @property
    def transport(self):
        if self._transport is None:
            self._transport = TcpLink(credential=self.credential, tls=self.tls)
        return self._transport

    async def copy(self, key: bytes, generation: int, destination: str) -> int:
        """Write (key, generation) to `destination`; returns the bytes sent. Raises the typed
        error of whatever went wrong (not held here, destination refused or unreachable)."""
        if not destination:
            raise InvalidArgumentError("COPY without a destination address")
        rec, why = self.store.lookup(key, generation)
        if rec is None:
            if why == "stale":
                raise StaleReplicaError(f"this node no longer holds generation {generation} of the key")
            raise KeyNotFoundError(f"no generation {generation} of this key here")
        now = self.store.clock()
        options = WriteOptions(
            flags=rec.flags,
            ttl_ms=_remaining_ms(rec.expires_at, now),
            soft_pin_ms=_remaining_ms(rec.soft_pin_until, now),
            raw_size=rec.raw_size if rec.raw_size != rec.size else 0)
        self.store.acquire(rec)  # neither freed nor moved between tiers while its bytes are sent
        try:
            if rec.dram is not None:
                data = self.store.dram.segment.view(rec.dram, rec.size)
            else:
                segment = self.store.ssd.segment
                data = memoryview(bytearray(rec.size))
                await asyncio.to_thread(segment.pread_into, data, segment.payload_offset(rec.ssd, len(rec.key)))
            await asyncio.wait_for(
                self.transport.write(destination, key, generation, data, rec.checksum, options), self.timeout)
        except TimeoutError:
            raise UnavailableError(f"COPY to {destination} not done within {self.timeout:g}s") from None
        finally:
            self.store.release(rec)
        return rec.size

    async def close(self) -> None:
        if self._transport is not None:
            await self._transport.close()


def _remaining_ms(until: float, now: float) -> int:
    """Milliseconds left until a unix time (0 = none set); an elapsed one keeps 1 ms so it stays set."""
    if not until:
        return 0
    return max(1, round((until - now) * 1000))
