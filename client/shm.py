"""Same-host shared memory: value bytes are copied through the node's DRAM mapping.

The node stays the authority: over the TCP connection to it (client/tcp.py)
the client ATTACHes once (the connection proved its credential) and learns which
/dev/shm file to map; a read LOCATEs (key, generation), which pins the extent
until RELEASE, copies it out and hashes the copy; a write ALLOCATEs an
extent, copies the value in and COMMITs, and the node checks the checksum
before keeping it. Whatever the client still holds when its connection drops
is given back by the node, so a crashed client leaks nothing.

The segment file is readable only by the node's user (mode 0600): a process
of another user cannot map it whatever it sends, and with a cluster secret set
a process of the same user is told its path only once it proved its credential.
"""

import asyncio
import concurrent.futures
import json
import mmap
import os
import time

import numpy
from typing import Sequence

from kvpool.protocol import transports, wire
from kvpool.protocol.checksum import Digest, checksum
from kvpool.errors import (DeviceCopyError, ForbiddenError, NoSpaceError, ProtocolError, UnavailableError,
                           ValueTooLargeError)
from kvpool.protocol.parts import Parts, pieces
from kvpool.net.tcp_connection import Location

from kvpool.client.tcp import TcpTransport
from kvpool.client.transport import DataPath, ReadItem, WriteItem

COPY_CHUNK = 512 * 1024  # copy and hash in pieces that are still in cache when hashed
PARALLEL_HASH_MIN = 1024 * 1024  # below this a hand-off to the hash thread costs more than it saves
_RELEASE_DELAY = 0.01  # RELEASEs wait this long for a request to ride with (seconds)
_SAFE_COPY_SECONDS = wire.LOCATE_LEASE / 2
_ATTACH, _LOCATE, _RELEASE = wire.Op.ATTACH, wire.Op.LOCATE, wire.Op.RELEASE
_ALLOCATE, _COMMIT = wire.Op.ALLOCATE, wire.Op.COMMIT
_PREFER_SSD = wire.WriteFlag.PREFER_SSD
# ALLOCATE only takes DRAM: a value the node would rather place on SSD goes over the socket.
_NOT_IN_DRAM = (NoSpaceError, ValueTooLargeError)
# Below this a value goes in one WRITE frame over the socket: ALLOCATE + copy + COMMIT costs two
# requests per value, which for small values is more than the bytes the socket would carry
# (batch_put here: TCP ahead up to 16 KiB, shm from 32 KiB).
SMALL_WRITE = 16 * 1024


class _Mapping:
    """One node's DRAM segment mapped here, and the connection that ATTACHed to it."""

    def __init__(self, path: str, size: int):
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError:
            raise ForbiddenError(f"not allowed to open the node's segment {path}") from None
        except OSError as exc:  # e.g. not this host's /dev/shm after all
            raise UnavailableError(f"cannot open the node's segment {path}: {exc}") from None
        try:
            if os.fstat(fd).st_size < size:
                raise UnavailableError(f"segment {path} is smaller than the {size} bytes the node announced")
            self.mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.path, self.size = path, size
        # Not prefaulted (unlike the node's own mapping): page tables for a whole large segment in
        # every client would cost memory and start-up time; a page faults in once, on first use.
        self.view = memoryview(self.mmap)
        self.connection = None

    def extent(self, location: Location, size: int) -> memoryview:
        if location.offset + size > self.size:
            raise ProtocolError(f"node placed {size} bytes at {location.offset} in a {self.size}-byte segment")
        return self.view[location.offset:location.offset + size]

    def close(self) -> None:
        try:
            self.view.release()
            self.mmap.close()
        except BufferError:  # a copy is still running somewhere: the mapping goes with the process
            pass


def copy_out(source: memoryview, dest) -> int:
    """Copy source into dest (a view or Parts), hashing each piece right after it lands;
    the checksum of what landed."""
    digest = Digest()
    position = 0
    for view in pieces(dest):
        size = len(view)
        for start in range(0, size, COPY_CHUNK):
            end = min(start + COPY_CHUNK, size)
            view[start:end] = source[position + start:position + end]
            digest.update(view[start:end])
        position += size
    return digest.intdigest()


class _Copier:
    """Copies objects out of a mapping and hashes them, for large ones on two cores at once.

    A large object's source extent is hashed in a helper thread while this thread copies it:
    both release the GIL, and on a machine of few cores the copy alone then sets the pace
    (about 25 % faster for 4 MiB objects read from memory than copying and hashing in turn).
    Hashing the source rather than the copy is sound because the node pins the extent for
    the whole copy (LOCATE), so both see the same bytes; the checksum still proves that
    what the node holds is the object.
    """

    def __init__(self):
        self._hasher: concurrent.futures.ThreadPoolExecutor | None = None

    def copy(self, source: memoryview, dest) -> int:
        if isinstance(dest, Parts):  # device memory's staging takes the extent by DMA where it can
            digest = dest.deliver_from(source)
            if digest is not None:
                return digest
        if len(source) < PARALLEL_HASH_MIN:
            return copy_out(source, dest)
        if self._hasher is None:
            self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-shm-hash")
        hashing = self._hasher.submit(checksum, source)
        try:
            position = 0
            for view in pieces(dest):
                # numpy copies without the GIL, so the hash thread runs meanwhile.
                numpy.copyto(numpy.frombuffer(view, numpy.uint8),
                             numpy.frombuffer(source[position:position + len(view)], numpy.uint8))
                position += len(view)
        finally:
            digest = hashing.result()  # never leave the thread reading a source that may be released
        return digest

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown()


async def _landed(buf) -> None:
    """What `buf` took by itself (device memory: client/device/staged.py) has arrived."""
    if isinstance(buf, Parts):
        await buf.landed()


def _undeliver(buf) -> None:
    """`buf` is filled again (over the socket): what its deliver_from took no longer counts."""
    if isinstance(buf, Parts):
        buf.undeliver()


def copy_in(extent: memoryview, data) -> None:
    """Copy a value (a view or Parts, which may fill it by itself: client/device/staged.py) into its extent."""
    if isinstance(data, Parts):
        data.copy_to(extent)
    else:
        extent[:] = data


class ShmPath(DataPath):
    """Shared memory to the nodes of this host, over the connections of `tcp`."""

    takes_parts = True  # sends from and receives into each part

    def __init__(self, tcp: TcpTransport):
        self.tcp = tcp  # its connections proved our credential: an ATTACH on one needs no more
        self._mappings: dict[str, _Mapping] = {}
        self.copier = _Copier()
        self.by_socket = 0  # value bytes this path sent over the TCP connection instead (SSD, no room in DRAM)
        self._attaching: dict[str, asyncio.Lock] = {}

    async def attach(self, address: str, hello: dict) -> None:
        """Map the node's segment; UnavailableError / ForbiddenError when this client may not."""
        if transports.SHM not in hello.get("transports", {}):
            raise UnavailableError(f"node {address} does not offer shared memory")
        if hello.get("host_id") != transports.host_id():
            raise UnavailableError(f"node {address} runs on another host")
        await self._mapping(address)

    async def _mapping(self, address: str) -> _Mapping:
        connection = await self.tcp.connection(address)
        mapping = self._mappings.get(address)
        if mapping is not None and mapping.connection is connection:
            return mapping
        lock = self._attaching.setdefault(address, asyncio.Lock())
        async with lock:
            connection = await self.tcp.connection(address)
            mapping = self._mappings.get(address)
            if mapping is not None and mapping.connection is connection:
                return mapping
            # A new connection (first use, or the old one dropped): the node forgot our ATTACH.
            body = await connection.request(_ATTACH, b"", 0, 0, 0)
            try:
                offer = json.loads(body)
                path, size = str(offer["path"]), int(offer["size"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ProtocolError(f"node {address}: bad ATTACH reply: {exc}") from None
            if mapping is None or mapping.path != path or mapping.size != size:
                if mapping is not None:
                    mapping.close()  # the node restarted with a new segment
                    del self._mappings[address]
                mapping = _Mapping(path, size)
                self._mappings[address] = mapping
            mapping.connection = connection
            return mapping

    async def read_into(self, address, key, generation, buf) -> int:
        mapping = await self._mapping(address)
        connection = mapping.connection
        answer = await connection.request(_LOCATE, key, generation, 0, len(buf), buf=buf)
        if not isinstance(answer, Location):
            self.by_socket += len(buf)
            return answer  # an SSD-only object: its bytes came over the socket, hashed on arrival
        leased = time.monotonic()
        try:
            digest = self.copier.copy(mapping.extent(answer, len(buf)), buf)
            await _landed(buf)
        finally:
            connection.defer(_RELEASE, ((key, generation),), _RELEASE_DELAY)
        if time.monotonic() - leased > _SAFE_COPY_SECONDS:
            # Copied while the pin may have lapsed: the checksum would catch a moved extent,
            # but reading it over the socket is cheaper than failing the get.
            _undeliver(buf)
            return await self._by_socket(len(buf), self.tcp.read_into(address, key, generation, buf))
        return digest

    async def read_many(self, address: str, items: Sequence[ReadItem]) -> list:
        mapping = await self._mapping(address)
        connection = mapping.connection
        answers = await connection.batch(_LOCATE, items)
        leased = time.monotonic()
        located = []
        try:
            for i, (item, answer) in enumerate(zip(items, answers)):
                if isinstance(answer, Location):
                    located.append((item.key, item.generation))
                    try:
                        answers[i] = self.copier.copy(mapping.extent(answer, len(item.buf)), item.buf)
                    except ProtocolError as exc:
                        answers[i] = exc
                elif not isinstance(answer, Exception):
                    self.by_socket += len(item.buf)
            for i, item in enumerate(items):  # copies to device memory all enqueued: now wait for them
                try:
                    await _landed(item.buf)
                except DeviceCopyError as exc:
                    answers[i] = exc
        finally:
            connection.defer(_RELEASE, located, _RELEASE_DELAY)
        if located and time.monotonic() - leased > _SAFE_COPY_SECONDS:
            for item in items:
                _undeliver(item.buf)
            answers = await self.tcp.read_many(address, items)
            self.by_socket += sum(len(item.buf) for item, a in zip(items, answers) if not isinstance(a, Exception))
        return answers

    async def _by_socket(self, size: int, transfer):
        """Await a transfer sent over the TCP connection instead, counting its bytes as such."""
        result = await transfer
        self.by_socket += size
        return result

    async def write(self, address, key, generation, data, checksum, options=None, term=0) -> None:
        if len(data) < SMALL_WRITE or options is not None and options.flags & _PREFER_SSD:
            return await self._by_socket(len(data), self.tcp.write(
                address, key, generation, data, checksum, options, term))
        mapping = await self._mapping(address)
        connection = mapping.connection
        try:
            answer = await connection.request(_ALLOCATE, key, generation, term, len(data), checksum, options=options)
        except _NOT_IN_DRAM:
            return await self._by_socket(len(data), self.tcp.write(
                address, key, generation, data, checksum, options, term))
        committed = False
        try:
            copy_in(mapping.extent(answer, len(data)), data)
            await connection.request(_COMMIT, key, generation, 0, len(data), checksum)
            committed = True
        finally:
            if not committed:
                await connection.post(_RELEASE, ((key, generation),))

    async def write_many(self, address: str, items: Sequence[WriteItem]) -> list:
        results: list = [None] * len(items)
        mapped, by_socket = [], []
        for i, item in enumerate(items):
            by_tcp = len(item.data) < SMALL_WRITE or item.options and item.options.flags & _PREFER_SSD
            (by_socket if by_tcp else mapped).append(i)
        if mapped:
            mapping = await self._mapping(address)
            connection = mapping.connection
            answers = await connection.batch(_ALLOCATE, [items[i] for i in mapped])
            filled = []
            try:
                for i, answer in zip(mapped, answers):
                    if isinstance(answer, Location):
                        filled.append(i)
                        copy_in(mapping.extent(answer, len(items[i].data)), items[i].data)
                    elif isinstance(answer, _NOT_IN_DRAM):
                        by_socket.append(i)
                    else:
                        results[i] = answer
                outcomes = await connection.batch(_COMMIT, [items[i] for i in filled])
            except BaseException:
                await connection.post(_RELEASE, [(items[i].key, items[i].generation) for i in filled])
                raise
            for i, outcome in zip(filled, outcomes):
                results[i] = outcome
        if by_socket:
            by_socket.sort()
            outcomes = await self.tcp.write_many(address, [items[i] for i in by_socket])
            for i, outcome in zip(by_socket, outcomes):
                results[i] = outcome
                if outcome is None:
                    self.by_socket += len(items[i].data)
        return results

    async def close(self) -> None:
        self.copier.close()
        for mapping in self._mappings.values():
            mapping.close()
        self._mappings.clear()
