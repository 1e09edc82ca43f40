"""kvpool/sharedfs/file_gate.py: which errors close the gate, calls bounded by their timeout and by the threads a
hung file system may hold, refusal at once while closed, and the probe that opens it again."""

import asyncio
import errno
import threading

import pytest

from kvpool.errors import BatchError, KeyNotFoundError, NoSpaceError, UnavailableError
from kvpool.net.netutil import wait_until
from kvpool.sharedfs.file_gate import FileGate, fault_of


def oserror(code: int) -> OSError:
    return OSError(code, f"errno {code}")


def typed(code: int) -> NoSpaceError:  # as kvpool/sharedfs/files.py raises them
    error = NoSpaceError("writing x: no room")
    error.__cause__ = oserror(code)
    return error


def test_errors_that_say_the_file_system_fails_are_told_from_those_about_one_name():
    assert fault_of(oserror(errno.EIO)).errno == errno.EIO
    assert fault_of(typed(errno.ENOSPC)).errno == errno.ENOSPC
    assert fault_of(oserror(errno.ENOENT)) is None
    assert fault_of(KeyNotFoundError("no such file")) is None
    assert fault_of(UnavailableError("a bucket's deadline")) is None  # a ConnectionError, not a disk's
    batch = BatchError("1 of 2 failed", {"b": typed(errno.EROFS)}, [4096, typed(errno.EROFS)])
    assert fault_of(batch).errno == errno.EROFS


class Probe:
    def __init__(self):
        self.healthy = threading.Event()

    def __call__(self):
        if not self.healthy.is_set():
            raise oserror(errno.EIO)


def failing(code: int):
    def call():
        raise oserror(code)
    return call


def test_an_io_error_closes_the_gate_and_calls_are_refused_at_once_until_the_probe_answers():
    probe, changes = Probe(), []
    gate = FileGate("test tier", probe, timeout=5, probe_every=0.01, on_change=changes.append)

    async def scenario():
        assert await gate.run(lambda: 7) == 7
        with pytest.raises(FileNotFoundError):
            await gate.run(failing(errno.ENOENT))
        assert gate.fault is None  # one missing file says nothing of the tier
        with pytest.raises(OSError):
            await gate.run(failing(errno.EIO))
        assert gate.fault.startswith("EIO")
        with pytest.raises(UnavailableError, match="is skipped: EIO"):
            await gate.run(lambda: 7)
        probe.healthy.set()
        await asyncio.to_thread(wait_until, lambda: gate.fault is None, 10, what="the gate to open")
        assert await gate.run(lambda: 8) == 8

    asyncio.run(scenario())
    assert changes[0].startswith("EIO") and changes[-1] is None and gate.faults == 1


def test_a_call_that_hangs_is_waited_for_no_longer_than_its_timeout_and_holds_only_the_gates_threads():
    release = threading.Event()
    gate = FileGate("hung tier", Probe(), threads=2, timeout=0.2, probe_every=60)

    async def scenario():
        with pytest.raises(UnavailableError, match="did not answer within 0.2s"):
            await gate.run(release.wait)
        assert "did not answer" in gate.fault
        # the loop's own executor is untouched by the hung thread
        assert await asyncio.get_running_loop().run_in_executor(None, lambda: 3) == 3

    asyncio.run(scenario())
    release.set()


def test_every_thread_held_by_hung_calls_closes_the_gate_rather_than_queueing():
    release = threading.Event()
    gate = FileGate("busy tier", Probe(), threads=2, timeout=None, probe_every=60)

    async def scenario():
        hung = [asyncio.ensure_future(gate.run(release.wait)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(UnavailableError, match="2 calls have not come back"):
            await gate.run(lambda: 1)
        release.set()
        await asyncio.gather(*hung)

    asyncio.run(scenario())


def test_a_blocking_caller_gets_the_same_bounds():
    release = threading.Event()
    gate = FileGate("tier", Probe(), timeout=5, probe_every=60)
    assert gate.run_blocking(lambda: 5) == 5
    with pytest.raises(UnavailableError, match="did not answer within 0.1s"):
        gate.run_blocking(release.wait, timeout=0.1)
    with pytest.raises(UnavailableError, match="is skipped"):
        gate.run_blocking(lambda: 5)
    release.set()
