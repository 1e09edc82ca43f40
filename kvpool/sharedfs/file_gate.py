"""Calls into a file system that may fail or stop answering (a shared mount whose server hangs, a disk that
returns errors), made from an event loop or a caller with a deadline.

Each call runs in a daemon thread of the gate's own, at most `threads` at once, so a hung mount holds those
threads and nothing else (never the loop's default executor, which the SSD's writes share, nor the process's exit),
and is waited for within a timeout. A call that fails with an I/O error, or does not answer in time, closes the
gate: until a probe (a small write, fsync and read of the tier's own) answers, every call is refused at once
with UnavailableError naming why, and the tier is skipped by those who ask `fault`. A probe runs every
`probe_every` seconds while the gate is closed, each in a thread of its own and within the timeout."""

import asyncio
import concurrent.futures
import errno
import logging
import queue
import threading
import time

from kvpool.errors import KvpoolError, UnavailableError

log = logging.getLogger(__name__)

# What a file system says of one name, not of itself: the tier is fine.
_NOT_FAULTS = (errno.ENOENT, errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENOTEMPTY, errno.ENAMETOOLONG)


def fault_of(exc: BaseException | None) -> OSError | None:
    """The OSError behind an exception from a file call that says the file system itself fails (EIO, ENOSPC,
    EROFS, ...), looked for in its causes (kvpool/sharedfs/files.py types them) and a BatchError's results."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError) and not isinstance(exc, KvpoolError):  # (UnavailableError is one too)
            return exc if exc.errno is not None and exc.errno not in _NOT_FAULTS else None
        for result in getattr(exc, "results", None) or ():
            if isinstance(result, BaseException) and result is not exc:
                found = fault_of(result)
                if found is not None:
                    return found
        exc, seen = exc.__cause__, seen + 1
    return None


def describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno:
        return f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


class _Threads:
    """Daemon threads taking calls from one queue; `busy` counts those inside a call (a hung one stays busy)."""

    def __init__(self, limit: int, name: str):
        self.limit, self.name = limit, name
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.started = self.busy = 0

    def submit(self, function, args) -> concurrent.futures.Future | None:
        """The call's future, or None when every thread is inside a call already."""
        with self.lock:
            if self.busy >= self.limit:
                return None
            self.busy += 1
            if self.started < self.busy:
                self.started += 1
                threading.Thread(target=self._work, name=f"{self.name}-{self.started}", daemon=True).start()
        future = concurrent.futures.Future()
        self.calls.put((future, function, args))
        return future

    def _work(self) -> None:
        while True:
            future, function, args = self.calls.get()
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(function(*args))
                    except BaseException as exc:  # handed to the waiter
                        future.set_exception(exc)
            finally:
                with self.lock:
                    self.busy -= 1


class FileGate:
    """name: what the log and errors call the tier ("shared tier /mnt/kv"); probe(): a blocking check that the
    file system answers and takes writes (raises if not); timeout: seconds a call may take (None: no limit,
    for calls whose length grows with the tier, e.g. a scan); on_change(fault): told when the gate closes
    (the reason) and opens again (None)."""

    def __init__(self, name: str, probe, threads: int = 8, timeout: float | None = 10.0,
                 probe_every: float = 1.0, on_change=None):
        self.name = name
        self.probe = probe
        self.timeout = timeout
        self.probe_every = probe_every
        self.on_change = on_change
        self.fault: str | None = None  # why the gate is closed; None while open
        self.faults = 0  # times it closed
        self._since = 0.0
        self._threads = _Threads(threads, "kvpool-files")
        self._probing = False
        self._lock = threading.Lock()

    # -- calls

    async def run(self, function, *args, timeout: float | None | bool = True):
        """function(*args) in one of the gate's threads, within `timeout` seconds (True: the gate's own)."""
        future = self._submit(function, args)
        limit = self.timeout if timeout is True else timeout
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except (asyncio.TimeoutError, TimeoutError):
            raise self._hung(limit) from None
        except Exception as exc:
            self._failed(exc)
            raise

    def run_blocking(self, function, *args, timeout: float | None = None):
        """The same for a blocking caller: waits at most `timeout` (None: the gate's own)."""
        future = self._submit(function, args)
        limit = self.timeout if timeout is None else timeout
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            raise self._hung(limit) from None
        except Exception as exc:
            self._failed(exc)
            raise

    def _submit(self, function, args) -> concurrent.futures.Future:
        if self.fault is not None:
            self._probe_soon()
            raise UnavailableError(f"{self.name} is skipped: {self.fault}")
        future = self._threads.submit(function, args)
        if future is None:
            raise self.close(f"{self._threads.limit} calls have not come back")
        return future

    def _hung(self, limit) -> UnavailableError:
        return self.close(f"a call did not answer within {limit:g}s")

    def _failed(self, exc: BaseException) -> None:
        """A call's error goes to its caller as it is; one that says the file system fails closes the gate."""
        fault = fault_of(exc)
        if fault is not None:
            self.close(describe(fault))

    # -- closing and opening

    def close(self, why: str) -> UnavailableError:
        """Close the gate (if open) for `why`; the error a caller then raises."""
        with self._lock:
            opened = self.fault is None
            if opened:
                self.fault, self._since = why, time.monotonic()
                self.faults += 1
        if opened:
            log.error("%s fails (%s): skipped until it answers again (probed every %gs)", self.name, why,
                      self.probe_every)
            if self.on_change is not None:
                self.on_change(why)
        self._probe_soon()
        return UnavailableError(f"{self.name}: {why}")

    def _probe_soon(self) -> None:
        with self._lock:
            if self._probing or self.fault is None:
                return
            self._probing = True
        threading.Thread(target=self._probe_until_open, name="kvpool-files-probe", daemon=True).start()

    def _probe_until_open(self) -> None:
        """Probes until one answers; each in a thread of its own, so a hung probe is waited for no longer
        than the timeout and the next one is not held by it."""
        try:
            while True:
                time.sleep(self.probe_every)
                done = concurrent.futures.Future()
                threading.Thread(target=self._probe_once, args=(done,), daemon=True).start()
                try:
                    done.result(self.timeout or 10.0)
                except Exception:  # noqa: BLE001 - not yet
                    continue
                with self._lock:
                    down_for, self.fault = time.monotonic() - self._since, None
                log.warning("%s answers again after %.1fs", self.name, down_for)
                if self.on_change is not None:
                    self.on_change(None)
                return
        finally:
            with self._lock:
                self._probing = False

    def _probe_once(self, done: concurrent.futures.Future) -> None:
        try:
            self.probe()
            done.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - reported through the future
            done.set_exception(exc)

    def status(self) -> dict:
        """For a node's REPORT and health: the fault (None while open), since when, and how many so far."""
        return {"fault": self.fault, "down_for": round(time.monotonic() - self._since, 1) if self.fault else 0.0,
                "faults": self.faults}
