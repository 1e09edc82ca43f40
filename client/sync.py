"""Client: the blocking kvpool API, for callers without an event loop.

It runs on the same machinery as AsyncClient with the blocking io (waiting.py): the
coroutine of AsyncClient's method (or, where that method only hands its
arguments on, the machinery's own: a put is writes.put) runs in the calling
thread with its master calls and node requests answered on their sockets, so
puts and gets over TCP run no event loop; a private event loop runs in this
thread only for what needs one (a first connection, finding a leader, TLS,
shared memory, UCX). Lookups (exists, batch_exists) skip even the coroutine:
the request is built, sent on the leader's control connection and its answer
read in the caller's thread, the loop taking over only to find or follow a
leader; a batch_exists without a hold goes as a LOOKUP, its keys and answer
without protobuf (MasterLink.lookup_now). Handing each call to a separate loop
thread instead would cost two thread wake-ups per call (about 100 us here, half
of a 64 KiB get). Threads
sharing a Client take turns; a thread that wants many transfers in flight uses
the batch calls, or an AsyncClient. A thread that is itself running an event
loop cannot run a second one, so its calls are driven from a helper thread
instead (and block that loop, as any blocking call does).
"""

import asyncio
import concurrent.futures
import functools
import threading

from kvpool.errors import UnavailableError
from kvpool.protocol.keys import MAX_LIST_LIMIT, validate_keys

from kvpool.client import convert, writes
from kvpool.client.aio import AsyncClient
from kvpool.client.assembly import Core
from kvpool.client.waiting import BlockingIO


def _blocking(async_method):
    """A method that runs AsyncClient.<method> (waiting.py's run) and returns its result."""

    @functools.wraps(async_method)
    def method(self, *args, **kwargs):
        return self._run(async_method(self._client, *args, **kwargs))

    return method


def _forwarded(operation, async_method):
    """AsyncClient.<method> where it only hands its arguments to `operation` of the machinery: the
    operation itself is run, with the client's parts (the same arguments, documentation and errors)."""

    @functools.wraps(async_method)
    def method(self, *args, **kwargs):
        return self._run(operation(self._core, *args, **kwargs))

    return method


class Client:
    """Client("HOST:PORT") or Client(etcd="HOST:PORT", cluster="default"); options as AsyncClient."""

    def __init__(self, address: str | None = None, **options):
        self._io = BlockingIO()
        try:
            self._core = Core(address, io=self._io, **options)
        except BaseException:
            self._io.close()
            raise
        self._client = AsyncClient(_core=self._core)
        self._turn = threading.Lock()  # one thread runs the loop (or a socket call) at a time
        self._closed = False
        # Starts its thread only when first used.
        self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-client")

    def _dispatch(self, fn, *args):
        """fn(*args) in this thread, or in the helper thread if this one runs an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop runs here
            return fn(*args)
        return self._helper.submit(fn, *args).result()

    def _run(self, coro):
        return self._dispatch(self._drive, coro)

    def _drive(self, coro):
        with self._turn:
            if self._closed:
                coro.close()
                raise UnavailableError("client is closed")
            return self._io.run(coro)

    def _call(self, method: str, request, timeout: float | None):
        """Master.<method>, answered in this thread (MasterLink.call_now) within the call's deadline."""
        return self._bounded(timeout, method, self._call_now, method, request)

    def _bounded(self, timeout: float | None, name: str, fn, *args):
        """fn(*args, deadline) dispatched within the deadline of a call named `name` (a typed error past it)."""
        call = self._core.bounded(timeout, name, armed=False)
        try:
            return self._dispatch(fn, *args, call.when)
        except Exception as exc:
            error = call.overdue(exc)
            if error is None:
                raise
            raise error from exc

    def _call_now(self, method: str, request, deadline: float):
        with self._turn:
            if self._closed:
                raise UnavailableError("client is closed")
            return self._core.master.call_now(method, request, deadline)

    def _lookup_now(self, keys: list, deadline: float):
        with self._turn:
            if self._closed:
                raise UnavailableError("client is closed")
            return self._core.master.lookup_now(keys, lambda: convert.batch_exists_request(keys, 0), deadline)

    put = _forwarded(writes.put, AsyncClient.put)
    get = _blocking(AsyncClient.get)
    get_into = _blocking(AsyncClient.get_into)
    size = _blocking(AsyncClient.size)
    batch_put = _forwarded(writes.batch_put, AsyncClient.batch_put)
    batch_get = _blocking(AsyncClient.batch_get)
    batch_get_into = _blocking(AsyncClient.batch_get_into)
    put_from = _forwarded(writes.put, AsyncClient.put_from)
    batch_put_from = _blocking(AsyncClient.batch_put_from)
    put_parts = _blocking(AsyncClient.put_parts)
    get_into_parts = _blocking(AsyncClient.get_into_parts)
    batch_put_parts = _blocking(AsyncClient.batch_put_parts)
    batch_get_into_parts = _blocking(AsyncClient.batch_get_into_parts)
    remove = _blocking(AsyncClient.remove)
    remove_prefix = _blocking(AsyncClient.remove_prefix)
    stats = _blocking(AsyncClient.stats)
    list_keys = _blocking(AsyncClient.list_keys)
    drain = _blocking(AsyncClient.drain)
    tenants = _blocking(AsyncClient.tenants)
    flush = _blocking(AsyncClient.flush)

    def exists(self, key: str, hold: float = 0, *, timeout: float | None = None) -> bool:
        return convert.exists_answer(self._call("Exists", convert.exists_request(self._core.stored(key), hold), timeout))

    def batch_exists(self, keys, hold: float = 0, *, timeout: float | None = None) -> list:
        keys = self._core.stored_keys(list(keys))
        if hold == 0 and type(hold) in (int, float):  # no hold: a LOOKUP (MasterLink.lookup_now)
            validate_keys(keys)
            if not keys:
                return []
            return convert.batch_exists_answer(self._bounded(timeout, "BatchExists", self._lookup_now, keys), len(keys))
        request = convert.batch_exists_request(keys, hold)
        if request is None:
            return []
        return convert.batch_exists_answer(self._call("BatchExists", request, timeout), len(keys))

    def iter_keys(self, prefix: str = "", *, timeout: float | None = None):
        """Every stored key beginning with `prefix`, in byte order, a page (list_keys) at a time."""
        cursor = None
        while True:
            keys, cursor = self.list_keys(prefix, MAX_LIST_LIMIT, cursor, timeout=timeout)
            yield from keys
            if cursor is None:
                return

    exists.__doc__ = AsyncClient.exists.__doc__
    batch_exists.__doc__ = AsyncClient.batch_exists.__doc__

    def register_buffer(self, buffer) -> None:
        self._client.register_buffer(buffer)

    def bytes_by_transport(self) -> dict:
        return self._client.bytes_by_transport()

    def device_memory(self) -> dict:
        return self._client.device_memory()

    def transport_for(self, address: str) -> str | None:
        return self._client.transport_for(address)

    def close(self) -> None:
        """Close connections and the loop; later calls raise UnavailableError."""
        try:
            self._dispatch(self._close)
        finally:
            self._helper.shutdown()

    def _close(self) -> None:
        with self._turn:
            if self._closed:
                return
            self._closed = True
            try:
                self._io.run(self._client.close())
            finally:
                self._io.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
