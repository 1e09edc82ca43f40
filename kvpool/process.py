"""What every kvpool server process does around its asyncio main: logging to stderr, Ctrl-C as a clean exit."""

import asyncio
import logging
import sys


def run_server(main_coro) -> int:
    """Run `main_coro` (returning an exit code) with the common logging setup."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return asyncio.run(main_coro)
    except KeyboardInterrupt:
        return 0
