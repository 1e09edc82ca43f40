"""Sending part of a file to a non-blocking socket with os.sendfile, on any asyncio event loop.

loop.sock_sendfile exists only on the standard loop (uvloop has none), and the
storage node runs on uvloop when it is installed. This waits for the socket to
take more with add_writer, which every loop has.
"""

import asyncio
import os
import socket


async def send_file(sock: socket.socket, file, offset: int, count: int) -> None:
    """Send `count` bytes of `file` (a file object or descriptor) from `offset`; raises
    ConnectionError if the file ends first or the peer goes."""
    loop = asyncio.get_running_loop()
    out = sock.fileno()
    source = file if isinstance(file, int) else file.fileno()
    while count > 0:
        try:
            sent = os.sendfile(out, source, offset, count)
        except (BlockingIOError, InterruptedError):
            await _writable(loop, out)
            continue
        if sent == 0:
            raise ConnectionError(f"file ended {count} bytes before the range did")
        offset += sent
        count -= sent


async def _writable(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    ready = loop.create_future()
    loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_writer(fd)
