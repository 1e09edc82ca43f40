"""What every kvpool server process does around its asyncio main: logging to stderr, Ctrl-C as a clean exit."""

import asyncio
import gc
import logging
import os
import sys

# KVPOOL_EVENT_LOOP=asyncio runs a server that asks for uvloop on the standard loop instead.
EVENT_LOOP_ENV = "KVPOOL_EVENT_LOOP"


def _loop_factory(fast: bool):
    """uvloop's loop when `fast` and it is installed: it serves a small request several times cheaper
    than the standard loop (measured on the master's control port). Such servers must not use
    loop.sock_sendfile, which uvloop lacks (kvpool/sockets/socket_output.py works on both)."""
    if not fast or os.environ.get(EVENT_LOOP_ENV, "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_server(main_coro, fast_loop: bool = False) -> int:
    """Run `main_coro` (returning an exit code) with the common logging setup; on uvloop if
    `fast_loop` (see _loop_factory)."""
    # A server keeps millions of long-lived records (the master's table, a node's index) and frees
    # almost everything by reference count: collect the young generation 20x less often.
    gc.set_threshold(14_000, 10, 10)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with asyncio.Runner(loop_factory=_loop_factory(fast_loop)) as runner:
            return runner.run(main_coro)
    except KeyboardInterrupt:
        return 0
