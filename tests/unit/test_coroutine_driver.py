"""kvpool/runtime/coroutine_driver.py: what it relies on of asyncio, pinned, so that a Python release that changes
it fails here: a loop set running by hand without running is the one code finds (its futures, its tasks, no current
task) and is gone when unset; a coroutine's first steps run outside a Task and its rest in one, with results,
errors and cancellation passed as a Task passes them."""

import asyncio

import pytest

from kvpool.runtime.coroutine_driver import Resumed, resume, start


def test_a_coroutine_that_never_waits_finishes_in_its_first_step_on_the_loop_it_was_given():
    loop = asyncio.new_event_loop()
    seen = {}

    async def body():
        seen["loop"] = asyncio.get_running_loop()
        seen["task"] = asyncio.current_task()
        seen["future"] = asyncio.get_running_loop().create_future()
        seen["later"] = asyncio.get_running_loop().create_task(asyncio.sleep(0, "later"))
        seen["timer"] = loop.call_later(0, lambda: None)
        return "answer"

    try:
        assert start(body(), loop) == (True, "answer")
        assert seen["loop"] is loop
        assert seen["task"] is None
        assert seen["future"].get_loop() is loop
        assert seen["later"].get_loop() is loop and not seen["later"].done()  # runs when the loop next runs
        with pytest.raises(RuntimeError):  # set back: no loop runs here
            asyncio.get_running_loop()
        assert loop.run_until_complete(seen["later"]) == "later"
        seen["timer"].cancel()
    finally:
        loop.close()


def test_an_error_of_the_first_step_is_raised_and_the_loop_unset():
    loop = asyncio.new_event_loop()

    async def body():
        raise KeyError("first step")

    try:
        with pytest.raises(KeyError):
            start(body(), loop)
        with pytest.raises(RuntimeError):
            asyncio.get_running_loop()
    finally:
        loop.close()


def test_a_coroutine_waiting_on_a_future_is_finished_by_a_task_as_if_it_had_run_it():
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    steps = []

    async def body():
        steps.append("before")
        got = await future
        steps.append(("got", got))
        await asyncio.sleep(0)  # a bare yield, passed to the task as such
        steps.append(("task", asyncio.current_task() is not None))
        return got * 2

    try:
        coro = body()
        finished, waiting_on = start(coro, loop)
        assert not finished and waiting_on is future  # the future itself is what a wait yields
        assert steps == ["before"]
        loop.call_soon(future.set_result, 21)
        assert loop.run_until_complete(resume(coro, waiting_on)) == 42
        assert steps == ["before", ("got", 21), ("task", True)]
    finally:
        loop.close()


def test_an_error_set_on_the_future_waited_on_reaches_the_coroutine():
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    caught = []

    async def body():
        try:
            await future
        except ValueError as exc:
            caught.append(exc)
            raise

    try:
        coro = body()
        _, waiting_on = start(coro, loop)
        loop.call_soon(future.set_exception, ValueError("node said no"))
        with pytest.raises(ValueError):
            loop.run_until_complete(resume(coro, waiting_on))
        assert len(caught) == 1
    finally:
        loop.close()


def test_cancelling_the_task_cancels_what_the_coroutine_waits_on_and_it_sees_cancellation():
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    cleaned = []

    async def body():
        try:
            await future
        finally:
            cleaned.append(future.cancelled())

    async def main():
        coro = body()
        _, waiting_on = start(coro)  # on a running loop, outside any task (as the control port does)
        task = asyncio.get_running_loop().create_task(resume(coro, waiting_on))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task

    try:
        task = loop.run_until_complete(main())
        assert task.cancelled() and cleaned == [True]
    finally:
        loop.close()


def test_a_cancellation_the_task_throws_reaches_the_coroutine_at_a_bare_yield():
    """Nothing to cancel on the coroutine's behalf (it waits on no future): what the task throws is passed down."""
    loop = asyncio.new_event_loop()
    seen = []

    async def body():
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        seen.append("went on")

    async def main():
        coro = body()
        finished, waiting_on = start(coro)
        assert (finished, waiting_on) == (False, None)  # a bare yield
        task = asyncio.get_running_loop().create_task(resume(coro, waiting_on))
        await asyncio.sleep(0)  # its first step ran: the task waits a turn
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        loop.run_until_complete(main())
        assert seen == ["cancelled"]
    finally:
        loop.close()


def test_an_awaiting_coroutine_continues_one_already_started_in_its_own_task():
    """Resumed as a step of a longer coroutine (the blocking client's _continue)."""
    loop = asyncio.new_event_loop()
    future = loop.create_future()

    async def body():
        return await future + 1

    async def outer(coro, waiting_on):
        return ("outer", await Resumed(coro, waiting_on))

    try:
        coro = body()
        _, waiting_on = start(coro, loop)
        loop.call_soon(future.set_result, 1)
        assert loop.run_until_complete(outer(coro, waiting_on)) == ("outer", 2)
    finally:
        loop.close()


def test_closing_the_resumed_awaitable_closes_the_coroutine():
    loop = asyncio.new_event_loop()
    future = loop.create_future()
    closed = []

    async def body():
        try:
            await future
        except GeneratorExit:
            closed.append(True)
            raise

    try:
        coro = body()
        _, waiting_on = start(coro, loop)
        resumed = resume(coro, waiting_on)
        assert resumed.send(None) is future
        resumed.close()
        assert closed == [True]
    finally:
        loop.close()
