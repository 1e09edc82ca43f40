"""Client: the blocking kvpool API, for callers without an event loop.

It owns one AsyncClient and a private event loop, and runs that loop in the
calling thread for the length of each call. Handing each call to a separate
loop thread instead would cost two thread wake-ups per call (about 100 us here,
half of a 64 KiB get). Threads sharing a Client take turns; a thread that wants
many transfers in flight uses the batch calls, or an AsyncClient.
"""

import asyncio
import functools
import threading

from kvpool.errors import UnavailableError

from .aio import AsyncClient


def _blocking(async_method):
    """A method that runs AsyncClient.<method> on the client's loop thread and waits for it."""

    @functools.wraps(async_method)
    def method(self, *args, **kwargs):
        return self._run(async_method(self._client, *args, **kwargs))

    return method


class Client:
    """Client("HOST:PORT") or Client(etcd="HOST:PORT", cluster="default"); options as AsyncClient."""

    def __init__(self, address: str | None = None, **options):
        self._client = AsyncClient(address, **options)
        self._loop = asyncio.new_event_loop()
        self._turn = threading.Lock()  # one thread runs the loop at a time
        self._closed = False

    def _run(self, coro):
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
    exists = _blocking(AsyncClient.exists)
    batch_exists = _blocking(AsyncClient.batch_exists)
    remove = _blocking(AsyncClient.remove)
    remove_prefix = _blocking(AsyncClient.remove_prefix)
    stats = _blocking(AsyncClient.stats)

    def close(self) -> None:
        """Close connections and stop the loop thread; later calls raise UnavailableError."""
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
