"""One S3 bucket (and prefix) through obstore: blocking calls (callers run them in threads, as the shared tier's
file calls are run), each ending within the bucket's timeout, and failing as kvpool's typed errors: a missing
object is KeyNotFoundError; a store that is down, slow or throttling (503 SlowDown) past the timeout, or that
refuses the credentials, is UnavailableError naming what failed. obstore retries a failed request (with backoff)
only while the same timeout lasts: a caller's put or get of what the nodes hold never waits on the store.

obstore (the Rust object_store crate) was chosen over aiobotocore and boto3 by measuring the three against the
same SeaweedFS gateway, alternated, three rounds: 2 to 3 times their GET throughput for 32 KiB and 1 MiB objects,
and as fast for 32 MiB (benchmarks/README.md, "The object tier's client library").
"""

import datetime
from typing import Iterator

from ..errors import KeyNotFoundError, UnavailableError
from .settings import ObjectStoreSettings

DEFAULT_TIMEOUT = 10.0  # seconds a call to the store may take, retries included
LIST_PAGE = 1000  # names per page of a listing (S3's most)


class Bucket:
    """Objects under `settings.prefix` of the bucket; names here are relative to that prefix."""

    def __init__(self, settings: ObjectStoreSettings, timeout: float = DEFAULT_TIMEOUT):
        try:
            import obstore.store
        except ImportError:
            raise ValueError("the object store needs the obstore library: pip install 'kvpool[s3]'") from None

        self.settings = settings
        self.timeout = timeout
        # A request may take half the timeout, and a retry starts only within the first half: a call ends by it.
        half = datetime.timedelta(seconds=timeout / 2)
        options = {"timeout": half, "connect_timeout": min(half, datetime.timedelta(seconds=3)),
                   "allow_http": bool(settings.endpoint and settings.endpoint.startswith("http://"))}
        retry = {"max_retries": 3, "retry_timeout": half,
                 "backoff": {"init_backoff": datetime.timedelta(milliseconds=50),
                             "max_backoff": datetime.timedelta(seconds=1), "base": 2}}
        self._store = obstore.store.S3Store(settings.bucket, prefix=settings.prefix.rstrip("/") or None,
                                            client_options=options, retry_config=retry, **settings.store_config())

    def _call(self, what: str, name: str, function, *args, **kwargs):
        import obstore.exceptions

        try:
            return function(self._store, *args, **kwargs)
        except (obstore.exceptions.NotFoundError, FileNotFoundError):  # obstore raises the latter for a 404
            raise KeyNotFoundError(f"{name!r} not found in {self.settings.url}") from None
        except (obstore.exceptions.BaseError, OSError, TimeoutError) as exc:
            raise UnavailableError(f"the object store ({self.settings.url}) failed a {what} of {name!r}: "
                                   f"{_first_line(exc)}") from None

    def put(self, name: str, data) -> None:
        """Store `data` (bytes, a buffer, or a list of buffers sent in order) as `name`, replacing any."""
        import obstore

        body = data if not isinstance(data, list) else _joined(data)
        self._call("PUT", name, obstore.put, name, body)

    def get(self, name: str) -> memoryview:
        import obstore

        return memoryview(self._call("GET", name, lambda store, n: obstore.get(store, n).bytes(), name))

    def get_ranges(self, name: str, starts: list[int], ends: list[int]) -> list[memoryview]:
        """Byte ranges [start, end) of one object, fetched in parallel (ranges near each other in one request)."""
        import obstore

        return [memoryview(part) for part in self._call("ranged GET", name, obstore.get_ranges, name,
                                                        starts=starts, ends=ends, coalesce=0)]

    def size(self, name: str) -> int:
        import obstore

        return int(self._call("HEAD", name, obstore.head, name)["size"])

    def delete(self, name: str) -> None:
        """Remove `name`; removing one that is not there is not an error (as S3's DELETE)."""
        import obstore

        self._call("DELETE", name, obstore.delete, name)

    def list(self, prefix: str = "", *, offset: str | None = None) -> Iterator[list[tuple[str, int]]]:
        """Pages of (name, size) under `prefix`, in name order, after `offset` when given; each page a call."""
        import obstore

        stream = self._call("LIST", prefix, obstore.list, prefix or None, offset=offset, chunk_size=LIST_PAGE)
        while True:
            try:
                page = self._call("LIST", prefix, lambda store: next(stream))
            except StopIteration:
                return
            yield [(meta["path"], int(meta["size"])) for meta in page]


def _joined(parts: list) -> bytes:
    """One body of several buffers (S3 takes one per PUT; a multipart upload is for much larger objects)."""
    return b"".join(memoryview(part).cast("B") for part in parts)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
