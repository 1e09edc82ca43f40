"""Sending on a non-blocking socket from asyncio, on any event loop, with a bound on a stalled peer.

loop.sock_sendfile exists only on the standard loop (uvloop has none), and the
storage node runs on uvloop when it is installed; loop.sock_sendall waits for
ever on a peer that stops reading. These wait for the socket to take more with
add_writer, which every loop has, and give up with PeerStalled when it takes
nothing for `stall_timeout` seconds (None: wait as long as it takes). On a TLS
socket (kvpool/security/tls_socket.py) they also see its encrypted backlog out, and a
file goes through a buffer (sendfile would bypass the encryption).
"""

import asyncio
import os
import socket


FILE_CHUNK = 1024 * 1024  # a file sent over TLS goes through a buffer this large
IOV_MAX = 512  # buffers per sendmsg call; below the usual IOV_MAX of 1024


class PeerStalled(TimeoutError):
    """The peer took no byte for the whole stall timeout."""


def sendmsg_some(sock, parts: list, first: int) -> tuple[int, int]:
    """One sendmsg of parts[first:], as much as the socket takes now (none if it is full): the index of
    the first part not wholly sent and how many of its bytes were. The blocking and the asyncio
    senders of many buffers wait differently for the rest; this step is theirs alike."""
    try:
        sent = sock.sendmsg(parts[first:first + IOV_MAX])
    except (BlockingIOError, InterruptedError):
        sent = 0
    i, n = first, len(parts)
    while i < n and sent >= len(parts[i]):
        sent -= len(parts[i])
        i += 1
    return i, sent


async def send_all(sock: socket.socket, data, stall_timeout: float | None = None) -> None:
    """Send every byte of `data`."""
    view = memoryview(data).cast("B")
    loop = asyncio.get_running_loop()
    while view:
        try:
            sent = sock.send(view)
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock.fileno(), stall_timeout)
            continue
        view = view[sent:]
    if getattr(sock, "backlog", None):
        await flush_backlog(sock, stall_timeout)


async def flush_backlog(sock, stall_timeout: float | None = None) -> None:
    """Wait until a TLS socket sent the encrypted bytes it holds (nothing to do on a plain one)."""
    loop = asyncio.get_running_loop()
    while getattr(sock, "backlog", None):
        try:
            sock.push()
        except (BlockingIOError, InterruptedError):
            await _writable(loop, sock.fileno(), stall_timeout)


async def send_file(sock: socket.socket, file, offset: int, count: int, stall_timeout: float | None = None) -> None:
    """Send `count` bytes of `file` (a file object or descriptor) from `offset`; raises ConnectionError
    if the file ends first or the peer goes."""
    loop = asyncio.get_running_loop()
    out = sock.fileno()
    source = file if isinstance(file, int) else file.fileno()
    if hasattr(sock, "backlog"):  # TLS: the bytes must pass through the encryption
        chunk = bytearray(min(count, FILE_CHUNK))
        while count > 0:
            got = await loop.run_in_executor(None, os.preadv, source, [memoryview(chunk)[:min(count, len(chunk))]],
                                             offset)
            if got <= 0:
                raise ConnectionError(f"file ended {count} bytes before the range did")
            await send_all(sock, memoryview(chunk)[:got], stall_timeout)
            offset += got
            count -= got
        return
    while count > 0:
        try:
            sent = os.sendfile(out, source, offset, count)
        except (BlockingIOError, InterruptedError):
            await _writable(loop, out, stall_timeout)
            continue
        if sent == 0:
            raise ConnectionError(f"file ended {count} bytes before the range did")
        offset += sent
        count -= sent


async def writable(sock, stall_timeout: float | None = None) -> None:
    await _writable(asyncio.get_running_loop(), sock.fileno(), stall_timeout)


async def _writable(loop: asyncio.AbstractEventLoop, fd: int, stall_timeout: float | None) -> None:
    ready = loop.create_future()
    loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
    try:
        async with asyncio.timeout(stall_timeout):
            await ready
    except TimeoutError:
        raise PeerStalled(f"the peer took nothing for {stall_timeout:g}s") from None
    finally:
        loop.remove_writer(fd)
