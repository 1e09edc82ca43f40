"""Running asyncio code by hand: a coroutine's first steps outside any Task, its rest in one.

Why: most calls never wait. The blocking Client's get or put (client/waiting.py) is
answered on its sockets in the caller's thread, and most of the master's control-port
calls (master/serving/control_port.py) complete inside the read that brought them. A
Task and a turn of the event loop for each cost a large part of the call: with every
blocking call run by loop.run_until_complete and every control-port coroutine in a task
of its own, a 1 KiB get over TCP took 169 us of the client's CPU instead of 94, a put
326 instead of 229, and an Exists 78 us of the master's CPU instead of 57 (Python 3.11,
20k calls each, medians of 3 rounds alternated). So the code written for asyncio (the
same that AsyncClient and the gRPC server run) is stepped by hand until it first waits,
and only then handed to a Task on the loop, which carries on from where it stopped as
if it had run it from the beginning.

This module is the only place that does so. What it relies on, pinned by
tests/unit/test_coroutine_driver.py (a Python release that changes it fails there):

- asyncio._set_running_loop(loop), exported by asyncio for event loops written
  outside it (uvloop) but undocumented: with it set and the loop not running,
  asyncio.get_running_loop() answers `loop` in this thread, asyncio.current_task()
  answers None, and futures, timers and tasks made are that loop's (they run when
  it next runs); set back to None, no loop runs here again. If it went away or
  changed, `start(coro, loop)` would fail (AttributeError), or code inside would
  raise "no running event loop" or see another loop.
- asyncio's protocol between an awaited future and the Task that runs the coroutine:
  a coroutine that waits on a Future suspends its whole stack by yielding that
  future (with `_asyncio_future_blocking` set), or yields None for a bare yield
  (asyncio.sleep(0)); the Task waits for a yielded future and resumes the coroutine
  with send(None), or throw()s into it what cancelled it. `Resumed` passes what the
  coroutine yields up to the Task and what the Task sends or throws down to the
  coroutine, so the Task drives it as it would have from the start. If the Task
  stopped accepting a future yielded through another awaitable's __await__, every
  resumed call would fail with a RuntimeError from the Task.

What a coroutine must not do in its first steps (outside a Task): anything that
needs the current Task, e.g. asyncio.timeout(), or asyncio.wait_for() from Python
3.12 on (it is built on asyncio.timeout there); those raise RuntimeError. The
blocking Client has its own deadlines for that (client/waiting.py _Deadline).

kvpool/sockets/socket_blocking.py run_now also completes a coroutine by hand (a
reply reader that never suspends); it relies on the language's coroutine protocol
alone, nothing of asyncio, and lives below this layer (kvpool/net uses it).
"""

from asyncio import events


def start(coro, loop=None) -> tuple[bool, object]:
    """Run `coro` in this thread up to where it first waits, outside any Task.

    loop: when no event loop runs in this thread, the loop the coroutine finds running meanwhile
    (its futures and the tasks it makes belong to it); None when called from a running loop's own
    callbacks (the coroutine finds that loop). Returns (True, its result) when it finished, else
    (False, what it waits on) for `Resumed`; raises what it raised."""
    if loop is None:
        try:
            return False, coro.send(None)
        except StopIteration as done:
            return True, done.value
    events._set_running_loop(loop)
    try:
        return False, coro.send(None)
    except StopIteration as done:
        return True, done.value
    finally:
        events._set_running_loop(None)


class Resumed:
    """Awaiting it continues a coroutine that `start` ran up to a wait (`waiting_on`, what it yielded),
    in the awaiting Task: results, errors and cancellation are passed on."""

    __slots__ = ("coro", "waiting_on")

    def __init__(self, coro, waiting_on):
        self.coro, self.waiting_on = coro, waiting_on

    def __await__(self):
        coro, yielded = self.coro, self.waiting_on
        while True:
            try:
                sent = yield yielded
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:
                try:
                    yielded = coro.throw(exc)
                except StopIteration as done:
                    return done.value
            else:
                try:
                    yielded = coro.send(sent)
                except StopIteration as done:
                    return done.value


async def resume(coro, waiting_on):
    """The rest of a coroutine that `start` left waiting on `waiting_on`, as a coroutine (for a Task)."""
    return await Resumed(coro, waiting_on)
