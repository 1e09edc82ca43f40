"""A WRITE of the blocking Client sent and answered on the node's socket itself.

The blocking Client runs its event loop only inside one caller's call. On a
connection with nothing else in flight, the next bytes from the node are the
reply to the next request, so a single WRITE need not go through the loop's
selector, a future and the connection's reader task: it is sent, and its reply
read, right here, with poll() waiting out a full or empty socket. The reader
task stays parked on the socket and sees nothing of it. Anything unexpected
fails the connection as its reader would; the next request opens a new one.
"""

import select
import time

from kvpool.protocol import wire
from kvpool.errors import Code, ProtocolError, UnavailableError, error_for
from kvpool.protocol.parts import pieces
from kvpool.net.tcp_connection import Connection
from kvpool.protocol.write_options import WriteOptions
from kvpool.sockets.socket_output import sendmsg_some

# A WRITE the node has not answered in this long (plus the time its bytes take at 50 MB/s)
# fails the connection: the loop-driven path has no such bound, a caller blocked here would.
WRITE_TIMEOUT = 30.0
_REPLY = wire.REPLY
_WRITE = int(wire.Op.WRITE)
_OK, _CHECKSUM_MISMATCH = int(Code.OK), int(Code.CHECKSUM_MISMATCH)


def write(connection: Connection, key: bytes, generation: int, term: int, data, checksum: int,
          options: WriteOptions | None) -> None:
    """Store `data` as (key, generation) on an idle connection; raises as Connection.request does."""
    size = len(data)
    req_id = connection.new_req_id()
    head = wire.pack_with_options(_WRITE, req_id, key, generation, term, size, checksum, options)
    parts = [*connection.take_deferred(), head, *pieces(data)]
    deadline = time.monotonic() + WRITE_TIMEOUT + size / 50e6
    poller = select.poll()
    poller.register(connection.sock, select.POLLIN)
    try:
        _send(connection.sock, parts, poller, deadline)
        header = _receive(connection.sock, _REPLY.size, poller, deadline)
        magic, version, op, got_id, status, _flags, length, _sum = _REPLY.unpack(header)
        if magic != wire.MAGIC or version != wire.VERSION or got_id != req_id or op != _WRITE:
            raise ProtocolError(f"node {connection.address}: unexpected reply (op {op}, req_id {got_id}) "
                                f"to WRITE {req_id}")
        body = _receive(connection.sock, length, poller, deadline) if length else b""
    except (OSError, EOFError, TimeoutError, ProtocolError) as exc:
        connection.fail(f"WRITE failed: {exc or type(exc).__name__}")
        if isinstance(exc, ProtocolError):
            raise
        raise UnavailableError(f"node {connection.address}: {exc or type(exc).__name__}") from None
    if status == _OK:
        return
    if status != _CHECKSUM_MISMATCH:
        # The node could not trust the payload that followed: it hangs up after this reply.
        connection.fail(f"node refused a WRITE ({Code(status).name}) and closes the connection")
    raise error_for(status, f"node {connection.address}: {bytes(body).decode('utf-8', 'replace')}")


def _wait(sock, poller: select.poll, events: int, deadline: float) -> None:
    poller.modify(sock, events)
    left = deadline - time.monotonic()
    if left <= 0 or not poller.poll(left * 1000):
        raise TimeoutError("the node did not answer in time")


def _send(sock, parts: list, poller: select.poll, deadline: float) -> None:
    i, n = 0, len(parts)
    while True:
        i, sent = sendmsg_some(sock, parts, i)
        if i == n:
            return
        if sent:
            parts[i] = memoryview(parts[i]).cast("B")[sent:]
        _wait(sock, poller, select.POLLOUT, deadline)


def _receive(sock, size: int, poller: select.poll, deadline: float) -> bytearray:
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        try:
            more = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            _wait(sock, poller, select.POLLIN, deadline)
            continue
        if not more:
            raise EOFError("connection closed by the node")
        got += more
    return data
