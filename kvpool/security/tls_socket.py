"""TLS on the data path's raw non-blocking sockets (kvpool/net/tcp_connection.py, storenode/serving/tcp_server.py).

Those move bytes with recv_into / sendmsg straight between sockets and caller buffers, which
asyncio's TLS transports cannot do; TlsSocket keeps that interface over an ssl.SSLObject fed
through memory BIOs. Plaintext methods behave as a non-blocking socket's: BlockingIOError when
nothing can move now, 0 from recv_into at the end of the stream. Encrypted bytes the socket could
not take yet stay in `backlog`; whoever sends waits for the socket to be writable and calls
push() until it is empty (socket_output.flush_backlog), as it would for a partial send.
"""

import ssl

from ..sockets.socket_input import readable
from ..sockets.socket_output import writable

RECV_CHUNK = 256 * 1024  # ciphertext read from the socket at once
SEND_CHUNK = 256 * 1024  # plaintext encrypted per step: the backlog stays small


class TlsSocket:
    def __init__(self, sock, context: ssl.SSLContext, server_side: bool, server_hostname: str | None = None):
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._ssl = context.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self.backlog = bytearray()  # ciphertext not sent yet

    # -- what callers use as they use a socket

    def fileno(self) -> int:
        return self.sock.fileno()

    def shutdown(self, how) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()

    def recv_into(self, view, nbytes: int = 0) -> int:
        view = memoryview(view)
        size = nbytes or len(view)
        while True:
            try:
                got = self._ssl.read(size, view)
                self._quiet_push()  # a read may have produced something to send (e.g. a key update)
                return got
            except ssl.SSLWantReadError:
                self._pull()  # BlockingIOError when the socket has nothing either
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return 0

    def send(self, data) -> int:
        return self.sendmsg((data,))

    def sendmsg(self, buffers) -> int:
        """Plaintext bytes taken (encrypted, and sent as far as the socket takes them)."""
        self.push()
        if self.backlog:
            raise BlockingIOError
        taken = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            while view:
                piece = view[:SEND_CHUNK]
                self._ssl.write(piece)
                taken += len(piece)
                view = view[len(piece):]
                self._collect()
                self._quiet_push()
                if self.backlog:
                    return taken
        return taken

    def push(self) -> None:
        """Send what ciphertext is waiting; BlockingIOError if the socket takes none of it."""
        self._collect()
        while self.backlog:
            sent = self.sock.send(self.backlog)
            del self.backlog[:sent]

    # -- the handshake, driven by the caller's waits

    def step_handshake(self) -> str | None:
        """Advance the handshake: None when done, else "read" or "write" (what to wait for)."""
        try:
            self._ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._quiet_push()
            if self.backlog:
                return "write"
            try:
                self._pull()
            except BlockingIOError:
                return "read"
            return self.step_handshake()
        except ssl.SSLError:
            self._quiet_push()  # the alert that tells the peer why
            raise
        self._quiet_push()
        return "write" if self.backlog else None

    # -- internals

    def _collect(self) -> None:
        if self._out.pending:
            self.backlog += self._out.read()

    def _quiet_push(self) -> None:
        try:
            self.push()
        except (BlockingIOError, InterruptedError):
            pass

    def _pull(self) -> None:
        data = self.sock.recv(RECV_CHUNK)
        if data:
            self._in.write(data)
        else:
            self._in.write_eof()


async def handshake(sock: TlsSocket) -> None:
    """Run the TLS handshake on a connected non-blocking socket (bound it with a timeout)."""
    while (want := sock.step_handshake()) is not None:
        await (writable(sock) if want == "write" else readable(sock))
