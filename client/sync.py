"""Client: the blocking kvpool API, for callers without an event loop.

It runs one AsyncClient on a private event-loop thread and waits for each
call there, so connections, pipelining and the placement cache are shared by
every thread using the Client.
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
        self._client = AsyncClient(address, **options)  # validates the arguments before a thread exists
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvpool-client", daemon=True)
        self._thread.start()
        self._closed = False

    def _run(self, coro):
        if self._closed:
            coro.close()
            raise UnavailableError("client is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        finally:
            future.cancel()  # no-op once done; stops the work if the caller was interrupted

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
        if self._closed:
            return
        self._closed = True
        try:
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
