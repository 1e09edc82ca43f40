"""Client: the blocking kvpool API, for callers without an event loop.

It owns one AsyncClient and a private event loop, and runs that loop in the
calling thread for the length of each call. Handing each call to a separate
loop thread instead would cost two thread wake-ups per call (about 100 us here,
half of a 64 KiB get). Threads sharing a Client take turns; a thread that wants
many transfers in flight uses the batch calls, or an AsyncClient. A thread that
is itself running an event loop cannot run a second one, so its calls are
driven from a helper thread instead (and block that loop, as any blocking call does).
"""

import asyncio
import concurrent.futures
import functools
import threading

from kvpool.errors import UnavailableError

from .aio import AsyncClient


def _blocking(async_method):
    """A method that runs AsyncClient.<method> on the client's loop and waits for it."""

    @functools.wraps(async_method)
    def method(self, *args, **kwargs):
        return self._run(async_method(self._client, *args, **kwargs))

    return method


class Client:
    """Client("HOST:PORT") or Client(etcd="HOST:PORT", cluster="default"); options as AsyncClient."""

    def __init__(self, address: str | None = None, **options):
        self._client = AsyncClient(address, _blocking=True, **options)
        self._loop = asyncio.new_event_loop()
        self._turn = threading.Lock()  # one thread runs the loop at a time
        self._closed = False
        # Starts its thread only when first used.
        self._helper = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-client")

    def _dispatch(self, fn, *args):
        """fn(*args) in this thread, or in the helper thread if this one runs an event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: no loop in this thread
            return fn(*args)
        return self._helper.submit(fn, *args).result()

    def _run(self, coro):
        return self._dispatch(self._drive, coro)

    def _drive(self, coro):
        with self._turn:
            if self._closed:
                coro.close()
                raise UnavailableError("client is closed")
            task = self._loop.create_task(coro)
            try:
                return self._loop.run_until_complete(task)
            finally:
                task.cancel()  # no-op once done; an interrupted call stops at the next turn

    put = _blocking(AsyncClient.put)
    get = _blocking(AsyncClient.get)
    get_into = _blocking(AsyncClient.get_into)
    batch_put = _blocking(AsyncClient.batch_put)
    batch_get = _blocking(AsyncClient.batch_get)
    batch_get_into = _blocking(AsyncClient.batch_get_into)
    put_from = _blocking(AsyncClient.put_from)
    batch_put_from = _blocking(AsyncClient.batch_put_from)
    put_parts = _blocking(AsyncClient.put_parts)
    get_into_parts = _blocking(AsyncClient.get_into_parts)
    batch_put_parts = _blocking(AsyncClient.batch_put_parts)
    batch_get_into_parts = _blocking(AsyncClient.batch_get_into_parts)
    exists = _blocking(AsyncClient.exists)
    batch_exists = _blocking(AsyncClient.batch_exists)
    remove = _blocking(AsyncClient.remove)
    remove_prefix = _blocking(AsyncClient.remove_prefix)
    stats = _blocking(AsyncClient.stats)
    drain = _blocking(AsyncClient.drain)
    flush = _blocking(AsyncClient.flush)

    def register_buffer(self, buffer) -> None:
        self._client.register_buffer(buffer)

    def bytes_by_transport(self) -> dict:
        return self._client.bytes_by_transport()

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
                self._loop.run_until_complete(self._client.close())
            finally:
                self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
