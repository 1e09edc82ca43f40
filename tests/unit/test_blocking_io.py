"""BlockingIO (client/waiting.py) runs a call's coroutine in the caller's thread: with no event loop running while
nothing needs one, on its private loop from the first wait that does; a timeout holds on either side."""

import asyncio
import time

import pytest

from kvpool.client.waiting import BlockingIO


@pytest.fixture
def io():
    blocking = BlockingIO()
    yield blocking
    blocking.close()


def test_a_call_that_waits_on_nothing_runs_no_loop(io):
    async def call():
        loop = asyncio.get_running_loop()  # futures and tasks made here belong to the private loop
        return loop is io.loop, loop.is_running(), asyncio.current_task()

    assert io.run(call()) == (True, False, None)


def test_a_call_continues_on_the_loop_from_its_first_wait(io):
    async def call():
        before = asyncio.current_task()
        await asyncio.sleep(0.01)
        return before, asyncio.current_task() is not None, asyncio.get_running_loop().is_running()

    assert io.run(call()) == (None, True, True)
    with pytest.raises(KeyError):
        io.run(_raises_after_a_wait())


async def _raises_after_a_wait():
    await asyncio.sleep(0)
    raise KeyError("late")


def test_a_timeout_entered_before_the_loop_ran_still_holds_on_it(io):
    async def call():
        try:
            async with io.timeout(0.2):
                await asyncio.sleep(30)
        except TimeoutError:
            return "timed out"

    started = time.monotonic()
    assert io.run(call()) == "timed out"
    assert time.monotonic() - started < 5


def test_in_a_gather_each_timeout_holds_in_its_own_transfer(io):
    async def stuck():
        async with io.timeout(0.2):
            await asyncio.sleep(30)

    async def quick(value):
        async with io.timeout(30):
            return value

    async def call():
        return await io.gather(quick(1), stuck(), quick(3), return_exceptions=True)

    started = time.monotonic()
    first, second, third = io.run(call())
    assert (first, third) == (1, 3) and isinstance(second, TimeoutError)
    assert time.monotonic() - started < 5
    assert io.run(quick(4)) == 4  # nothing of the earlier call is left behind
    assert not io._deadlines


def test_to_loop_lets_what_follows_wait_as_a_task(io):
    async def call():
        outside = asyncio.current_task()
        await io.to_loop()
        async with asyncio.timeout(5):  # needs a task
            return outside, asyncio.current_task() is not None

    assert io.run(call()) == (None, True)
