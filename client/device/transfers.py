"""The device pipeline: puts from and gets into device memory, every call's bytes through one staging pool.

A put: the copy stream first waits (device-side) for what the caller's stream holds, so the kernels that wrote
the value come first; then every chunk of the value is copied into staging at once, and each is hashed as it
lands, while the next ones are still copying. The value then goes out from staging like any buffer (its
checksum already known: the master is told it before any node gets a byte). Same host, the node's extent is
filled from the device again, by one DMA into its mapping, instead of by a memory copy out of staging.

A get: the bytes land in staging (or, same host, go by one DMA from the node's mapping to the device, hashed
from the mapping meanwhile), are verified, then copied to the device; the caller's stream waits for those
copies device-side, and the call returns once they are done, so a failed copy fails the call.

Batches go in waves of at most half the pool: while one wave's bytes cross the network, the next wave's copies
run (a put stages wave k+1 before writing wave k; a get reads wave k+1 while wave k goes to the device).
Staging is given back only once no copy uses it any more, also when a call is cancelled or fails.
"""

from contextlib import asynccontextmanager
from collections import Counter

from kvpool.errors import BatchError, DeviceCopyError, InvalidArgumentError
from kvpool.protocol.checksum import Digest, checksum

from ..values import readable_view, value_parts, writable_view
from .cuda import looks_like_cuda
from .staged import DeviceValue, Landing, Staged
from .staging import DEFAULT_CHUNK_SIZE, DEFAULT_POOL_SIZE, StagingPool, check_sizes


class DeviceTransfers:
    """A client's device memory handling: which objects are device memory, and the pipeline moving them."""

    def __init__(self, io, transport, pool_size: int | None = None, chunk_size: int | None = None, engine=None):
        self.io = io
        self._transport = transport
        self.pool_size = DEFAULT_POOL_SIZE if pool_size is None else pool_size
        self.chunk_size = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
        check_sizes(self.pool_size, self.chunk_size)
        self.engine = engine  # None until the first CUDA object (then the CUDA engine)
        self.pool: StagingPool | None = None
        self.moved: Counter = Counter()  # "<engine>:staged" / "<engine>:direct" -> value bytes

    # -- what is device memory

    def _engine_for(self, obj):
        engine = self.engine
        if engine is not None and engine.claims(obj):
            return engine
        if looks_like_cuda(obj):
            if engine is not None:
                raise InvalidArgumentError(f"CUDA memory given to a client copying with {engine.name}")
            from .cuda import CudaCopyEngine
            self.engine = CudaCopyEngine()
            return self.engine
        return None

    def _device(self, obj, what: str, writable: bool):
        if type(obj) is bytes or type(obj) is bytearray or type(obj) is memoryview:
            return None
        if type(obj) is DeviceValue:  # already taken (a slice of a device buffer, batch_put_from)
            return obj
        engine = self._engine_for(obj)
        return None if engine is None else DeviceValue(engine, [engine.region(obj, what, writable)])

    def readable(self, value):
        """A put's value: a flat view of host memory, or a DeviceValue."""
        device = self._device(value, "value", False)
        return readable_view(value) if device is None else device

    def writable(self, buffer):
        """A get's destination: a flat writable view of host memory, or a DeviceValue."""
        device = self._device(buffer, "buffer", True)
        return writable_view(buffer) if device is None else device

    def parts(self, buffers, writable: bool):
        """Parts of host buffers, or a DeviceValue of device buffers (not both in one value)."""
        if isinstance(buffers, (bytes, bytearray, memoryview)) or not hasattr(buffers, "__iter__"):
            return value_parts(buffers, "parts", writable)
        buffers = list(buffers)
        device = [self._device(b, "part", writable) for b in buffers]
        if all(value is None for value in device):
            return value_parts(buffers, "parts", writable)
        if any(value is None for value in device):
            raise InvalidArgumentError("a value's parts must all be device memory or all host memory")
        return DeviceValue(device[0].engine, [region for value in device for region in value.regions])

    # -- the pool

    def _pool(self) -> StagingPool:
        if self.pool is None:
            self.pool = StagingPool(self.engine, self.pool_size, self.chunk_size,
                                    on_allocated=self._transport.register_buffer)
        return self.pool

    def report(self) -> dict:
        """The staging pool's memory (bytes) and what moved, per path."""
        pool = {"pool_bytes": self.pool_size, "chunk_bytes": self.chunk_size, "allocated_bytes": 0,
                "in_use_bytes": 0, "peak_bytes": 0, "waits": 0} if self.pool is None else self.pool.report()
        return {**pool, "engine": None if self.engine is None else self.engine.name, "moved": dict(self.moved)}

    def _plan(self, items: list) -> tuple[list[int], list[list[int]]]:
        """The indices of a batch's host values (or destinations), and of its DeviceValues in waves of at most
        half the pool (one larger value goes alone)."""
        budget = self._pool().size // 2
        host, waves, current, used = [], [], [], 0
        for i, item in enumerate(items):
            if not isinstance(item, DeviceValue):
                host.append(i)
                continue
            if current and used + len(item) > budget:
                waves.append(current)
                current, used = [], 0
            current.append(i)
            used += len(item)
        if current:
            waves.append(current)
        return host, waves

    async def _lease(self, nbytes: int, finish_earlier):
        """Staging for `nbytes`: at once if free, else after finishing this call's earlier wave, then in turn."""
        pool = self._pool()
        lease = pool.try_take(nbytes)
        if lease is None:
            await finish_earlier()
            lease = await pool.take(nbytes)
        return lease

    def _settle(self, event, lease) -> None:
        """Give staging back once no copy uses it (a copy's error is the call's to report, if any); with no
        event, once every copy enqueued so far is done."""
        try:
            self.engine.wait(self.engine.record() if event is None else event)
        except DeviceCopyError:
            pass
        finally:
            self.pool.give(lease)

    async def _wait(self, event) -> None:
        engine = self.engine
        if not engine.done(event):
            await self.io.blocking(engine.wait, event)

    # -- puts

    def _start_out(self, values: list[DeviceValue], lease) -> list:
        """Enqueue the copies of `values`, one after the other, into the lease: per value (its staging view,
        [(chunk view, event after its copy)])."""
        engine, chunk = self.engine, self.chunk_size
        engine.copy_after_caller()
        pending, at = [], 0
        for value in values:
            chunks = []
            for offset, piece in value.spans(chunk):
                view = lease.view[at + offset:at + offset + piece.nbytes]
                engine.to_host(piece, view)
                chunks.append((view, engine.record()))
            pending.append((lease.view[at:at + value.size], chunks))
            at += value.size
        return pending

    async def _finish_out(self, values: list[DeviceValue], pending: list) -> list[Staged]:
        staged = []
        for value, (whole, chunks) in zip(values, pending):
            digest = Digest()
            for view, event in chunks:
                await self._wait(event)
                digest.update(view)
            staged.append(Staged(whole, digest.intdigest(), value, self))
            self.moved[f"{self.engine.name}:staged"] += value.size
        return staged

    @asynccontextmanager
    async def staged(self, value: DeviceValue):
        """A put's device value as Staged for the body (its staging given back after)."""
        pool = self._pool()
        lease = await pool.take(value.size)
        event = None
        try:
            pending = self._start_out([value], lease)
            event = self.engine.record()
            [staged] = await self._finish_out([value], pending)
            yield staged
        finally:
            self._settle(event, lease)

    async def put_waves(self, keys: list, views: list, send) -> dict:
        """Stage the device values among `views` wave by wave and `await send(indices, values, digests)` for
        each wave (host values go first, in one); key -> error of the puts that failed (send raises
        BatchError keyed by key)."""
        host, waves = self._plan(views)
        errors: dict = {}
        staged: list = []  # waves staged and not sent yet: (indices, values, lease, pending, event), oldest first

        async def send_oldest():
            indices, values, lease, pending, event = staged[0]
            try:
                ready = await self._finish_out(values, pending)
                await _sent(send, indices, ready, [s.digest for s in ready], errors)
            except DeviceCopyError as exc:
                errors.update(dict.fromkeys((keys[i] for i in indices), exc))
            finally:
                staged.pop(0)
                self._settle(event, lease)

        async def send_all():
            while staged:
                await send_oldest()

        try:
            if host:
                await _sent(send, host, [views[i] for i in host], [None] * len(host), errors)
            for wave in waves:
                values = [views[i] for i in wave]
                lease = await self._lease(sum(map(len, values)), send_all)
                staged.append((wave, values, lease, None, None))  # settled below until its copies are enqueued
                staged[-1] = (wave, values, lease, self._start_out(values, lease), self.engine.record())
                if len(staged) > 1:
                    await send_oldest()  # wave k is written while wave k+1's copies run
            await send_all()
        finally:
            for _, _, lease, _, event in staged:  # cancelled or failed while staged
                self._settle(event, lease)
        return errors

    def direct_out(self, source: DeviceValue, extent: memoryview) -> bool:
        """Fill a node's mapped extent from the device by DMA (Staged.copy_to); False where it cannot be."""
        engine = self.engine
        if not engine.register_host(extent):
            return False
        for offset, piece in source.spans(self.chunk_size):
            engine.to_host(piece, extent[offset:offset + piece.nbytes])
        engine.wait(engine.record())
        self.moved[f"{engine.name}:direct"] += source.size
        self.moved[f"{engine.name}:staged"] -= source.size  # counted when staged: these bytes left directly
        return True

    # -- gets

    def direct_in(self, source: memoryview, dest: DeviceValue):
        """Enqueue copies of a node's mapped extent to the device by DMA and hash the extent meanwhile:
        (its checksum, the event after the copies, for `landed`), or None when the mapping cannot be reached."""
        engine = self.engine
        if not engine.register_host(source):
            return None
        engine.copy_after_caller()
        for offset, piece in dest.spans(self.chunk_size, len(source)):
            engine.to_device(source[offset:offset + piece.nbytes], piece)
        event = engine.record()
        return checksum(source), event  # hashed while the copies run; the node pins the extent until RELEASE

    async def landed(self, event) -> None:
        """Wait, off the event loop, for copies to the device (they may wait for the caller's stream); the
        caller's stream then waits for them too."""
        await self._wait(event)
        self.engine.caller_after(event)

    async def read_waves(self, core, keys: list, dests: list, read) -> list:
        """reads.read (`read`) for destinations among which some are DeviceValues, wave by wave: per key the
        destination filled (its front as long as the value) or the error."""
        host, waves = self._plan(dests)
        results: list = [None] * len(keys)
        landing: list = []  # waves whose copies to the device are under way: (indices, lease, event), oldest first

        async def land_oldest():
            indices, lease, event = landing[0]
            try:
                await self.landed(event)
            except DeviceCopyError as exc:
                for i in indices:
                    if not isinstance(results[i], BaseException):
                        results[i] = exc
            finally:
                landing.pop(0)
                self._settle(event, lease)

        async def land_all():
            while landing:
                await land_oldest()

        try:
            if host:
                for i, result in zip(host, await read(core, [keys[i] for i in host], [dests[i] for i in host])):
                    results[i] = result
            for wave in waves:
                lease = await self._lease(sum(len(dests[i]) for i in wave), land_all)
                landing.append((wave, lease, None))  # settled below until its copies are enqueued
                landings, at = [], 0
                for i in wave:
                    landings.append(Landing(lease.view[at:at + len(dests[i])], dests[i], self,
                                            flexible=len(dests[i].regions) <= 1))
                    at += len(dests[i])
                outcomes = await read(core, [keys[i] for i in wave], landings)
                landing[-1] = (wave, lease, self._start_in(wave, outcomes, results))
                if len(landing) > 1:
                    await land_oldest()  # wave k lands on the device while wave k+1 was read
            await land_all()
        finally:
            for _, lease, event in landing:  # cancelled or failed under way
                self._settle(event, lease)
        return results

    def _start_in(self, wave: list, outcomes: list, results: list):
        """Enqueue the copies of a wave's verified landings to the device; the event after them."""
        engine = self.engine
        engine.copy_after_caller()
        for i, outcome in zip(wave, outcomes):
            if isinstance(outcome, BaseException):
                results[i] = outcome
                continue
            size = len(outcome)
            results[i] = outcome.dest[:size] if len(outcome.dest.regions) == 1 else outcome.dest
            if outcome.state["direct"]:
                self.moved[f"{engine.name}:direct"] += size
                continue
            view = outcome.views[0]  # a Landing keeps its one view, even empty
            for offset, piece in outcome.dest.spans(self.chunk_size, size):
                engine.to_device(view[offset:offset + piece.nbytes], piece)
            self.moved[f"{engine.name}:staged"] += size
        return engine.record()


async def _sent(send, indices: list, values: list, digests: list, errors: dict) -> None:
    try:
        await send(indices, values, digests)
    except BatchError as exc:
        errors.update(exc.errors)
