"""Waiting on a condition inside a test's own event loop, against a deadline (no sleep as synchronisation)."""

import asyncio


async def until(condition, seconds: float = 5.0, interval: float = 0.005) -> None:
    """Return once condition() holds; fail the test if it has not within `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(interval)
