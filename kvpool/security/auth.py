"""Who may talk to whom: the cluster secret, the two credentials made from it, and how a peer
proves one at connect time without ever sending it.

The cluster secret is held by the members (masters and storage nodes). From it come two keys:
the member key, which lets a peer send what only a master may send a node (FREE, COPY, HOLD,
REPORT, INVENTORY, EVICTIONS: everything that carries a term or drops data), and the client
key, which lets a peer put, get and remove through the master and write and read on nodes.
A client is given the *client token* (`kvpool token --client`): the client key itself, from
which the member key cannot be had. A process given the secret itself may act as either.

Every data and control connection begins with the server's challenge (a REPLY frame of op AUTH
carrying a fresh nonce; flag OPEN when the server runs without a secret). The peer answers
with an AUTH request: its role in `flags`, and its own nonce and an HMAC-SHA256 proof over both
nonces as payload; the server answers OK with its own proof over both nonces (so the peer knows
it reached a member, not an impostor collecting its KV blocks) or FORBIDDEN and closes. A peer
with a credential refuses a server that does not authenticate.
"""

import hashlib
import hmac
import logging
import os
import secrets
import stat
import time
from dataclasses import dataclass
from enum import IntFlag
from pathlib import Path

from ..protocol import wire
from ..errors import Code, ForbiddenError, ProtocolError, UnavailableError, error_for
from ..sockets.socket_input import readable
from ..sockets.socket_output import send_all
from .roles import Role  # noqa: F401 - also imported from here

log = logging.getLogger(__name__)

CLIENT_TOKEN_PREFIX = "kvpool-client-v1:"
NONCE = 32  # bytes of each side's nonce
PROOF = 32  # bytes of an HMAC-SHA256
MAX_REFUSAL = 8192  # longest AUTH reply a peer reads (a proof, or an error message)
MAX_SECRET = 4096  # bytes of a secret or token file


class ChallengeFlag(IntFlag):
    OPEN = 1  # the server has no secret: it takes any peer, and proves nothing


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"kvpool key v1 " + purpose, hashlib.sha256).digest()


def placement_key(secret: str) -> bytes:
    """The key of the leader's seals over placements (placement_seal.py): members only."""
    return _derive(secret.encode(), b"placement")


def new_secret() -> str:
    return secrets.token_hex(32)


def client_token(secret: str) -> str:
    """The credential to give clients: proves the client role, cannot be turned into the member's."""
    return CLIENT_TOKEN_PREFIX + _derive(secret.encode(), b"client").hex()


@dataclass(frozen=True)
class Credential:
    """What this process proves when it connects."""

    role: Role
    key: bytes

    @classmethod
    def for_client(cls, token: str) -> "Credential":
        """A client's credential from its token: a client token, or the cluster secret itself."""
        if token.startswith(CLIENT_TOKEN_PREFIX):
            try:
                key = bytes.fromhex(token[len(CLIENT_TOKEN_PREFIX):])
            except ValueError:
                raise ValueError("malformed client token (expected kvpool-client-v1:<hex>)") from None
            return cls(Role.CLIENT, key)
        return cls(Role.CLIENT, _derive(token.encode(), b"client"))

    @classmethod
    def for_member(cls, secret: str) -> "Credential":
        if secret.startswith(CLIENT_TOKEN_PREFIX):
            raise ValueError("a client token was given where the cluster secret is needed "
                             "(masters and storage nodes take the secret itself)")
        return cls(Role.MEMBER, _derive(secret.encode(), b"member"))


class Verifier:
    """A server's side: the keys of both roles, made from the cluster secret (None: open server)."""

    def __init__(self, secret: str | None):
        self.open = not secret
        if secret and secret.startswith(CLIENT_TOKEN_PREFIX):
            raise ValueError("a client token was given where the cluster secret is needed")
        self.keys = {} if self.open else {Role.CLIENT: _derive(secret.encode(), b"client"),
                                          Role.MEMBER: _derive(secret.encode(), b"member")}
        self.placement_key = None if self.open else placement_key(secret)  # checks the leader's seals

    def key(self, role: int) -> bytes | None:
        return self.keys.get(role)


def _proof(key: bytes, role: int, server_nonce: bytes, peer_nonce: bytes) -> bytes:
    return hmac.new(key, b"kvpool peer v1" + bytes([role]) + server_nonce + peer_nonce, hashlib.sha256).digest()


def _server_proof(key: bytes, server_nonce: bytes, peer_nonce: bytes) -> bytes:
    return hmac.new(key, b"kvpool server v1" + server_nonce + peer_nonce, hashlib.sha256).digest()


# -- the server's side, without I/O


class ServerHandshake:
    """One connection's handshake at a server: challenge() first, then answer() with the peer's AUTH."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.nonce = secrets.token_bytes(NONCE)

    def challenge(self) -> bytes:
        flags = ChallengeFlag.OPEN if self.verifier.open else 0
        return wire.pack_reply(wire.Op.AUTH, 0, Code.OK, NONCE, 0, flags) + self.nonce

    def answer(self, op: int, req_id: int, key_len: int, role: int, length: int, payload: bytes) -> tuple[Role, bytes]:
        """(the role proved, the OK reply to send) for a peer's first frame; ForbiddenError if it
        proves nothing (its message is for the peer: send it, then close)."""
        if op != wire.Op.AUTH:
            raise ForbiddenError("authenticate first: this server needs the cluster token "
                                 "(KVPOOL_TOKEN_FILE or KVPOOL_TOKEN)")
        if key_len or length != NONCE + PROOF or len(payload) != length:
            raise ForbiddenError("malformed AUTH frame")
        key = self.verifier.key(role)
        peer_nonce, proof = payload[:NONCE], payload[NONCE:]
        if key is None or not hmac.compare_digest(proof, _proof(key, role, self.nonce, peer_nonce)):
            raise ForbiddenError("wrong cluster token")
        reply = wire.pack_reply(wire.Op.AUTH, req_id, Code.OK, PROOF) + _server_proof(key, self.nonce, peer_nonce)
        return Role(role), reply


class Tickets:
    """One-use tickets a server hands out on authenticated connections (in HELLO), so that a transport
    with no handshake of its own (UCX's CONNECT) can be proved with one: an HMAC over a ticket, never
    the key. Bounded: at most MAX outstanding, each for TTL seconds."""

    TTL = 60.0
    MAX = 4096

    def __init__(self, clock=None):
        self.clock = clock or time.monotonic
        self._due: dict[bytes, float] = {}  # ticket -> expiry, oldest first

    def issue(self) -> bytes:
        now = self.clock()
        while self._due and (len(self._due) >= self.MAX or next(iter(self._due.values())) <= now):
            del self._due[next(iter(self._due))]
        ticket = secrets.token_bytes(NONCE)
        self._due[ticket] = now + self.TTL
        return ticket

    def take(self, ticket: bytes) -> bool:
        due = self._due.pop(ticket, None)
        return due is not None and due > self.clock()


def ticket_proof(key: bytes, role: int, ticket: bytes, bound_to: bytes) -> bytes:
    """A peer's proof over a ticket and what it binds the ticket to (e.g. its UCX worker address)."""
    return hmac.new(key, b"kvpool ticket v1" + bytes([role]) + ticket + bound_to, hashlib.sha256).digest()


def refusal(req_id: int, exc: ForbiddenError) -> bytes:
    return wire.pack_error(wire.Op.AUTH, req_id, Code.FORBIDDEN, str(exc))


# -- the peer's side, without I/O


class PeerHandshake:
    """A connecting peer's side: respond() to the challenge, then check() the server's reply."""

    def __init__(self, credential: Credential | None, server: str):
        self.credential = credential
        self.server = server
        self.nonce = secrets.token_bytes(NONCE)
        self.server_nonce = b""

    def respond(self, header: bytes, body: bytes) -> bytes:
        """The AUTH frame to send in answer to the server's first frame (b"" when the server is open
        and we have no credential); the server's error when it turned us away instead."""
        magic, version, op, _req_id, status, flags, length, _sum = wire.REPLY.unpack_from(header)
        if magic != wire.MAGIC or version != wire.VERSION:
            raise ProtocolError(f"{self.server} did not open with a kvpool challenge "
                                f"(magic {bytes(magic)!r}, version {version}): not a kvpool server of this version")
        if status != Code.OK:  # e.g. TURNED_AWAY at its connection limit
            raise error_for(status, f"{self.server}: {body.decode('utf-8', 'replace')}")
        if op != wire.Op.AUTH or len(body) != NONCE:
            raise ProtocolError(f"{self.server} opened with op {op}, not a challenge")
        self.server_nonce = body
        if flags & ChallengeFlag.OPEN:
            if self.credential is not None:
                raise ForbiddenError(f"{self.server} runs without a cluster secret and cannot prove it is a member; "
                                     "refusing to talk to it with a token set")
            return b""
        if self.credential is None:
            raise ForbiddenError(f"{self.server} needs the cluster token: set KVPOOL_TOKEN_FILE (or KVPOOL_TOKEN), "
                                 "or pass token=")
        role, key = self.credential.role, self.credential.key
        proof = _proof(key, role, self.server_nonce, self.nonce)
        return wire.REQUEST.pack(wire.MAGIC, wire.VERSION, wire.Op.AUTH, 0, 0, role, 0, 0,
                                 NONCE + PROOF, 0) + self.nonce + proof

    def check(self, reply: bytes) -> None:
        """The server's answer to our AUTH: its header and body (PROOF bytes, or an error message)."""
        _magic, _version, op, _req_id, status, _flags, length, _sum = wire.REPLY.unpack_from(reply)
        body = reply[wire.REPLY.size:wire.REPLY.size + length]
        if status != Code.OK:
            raise ForbiddenError(f"{self.server} refused our credential: {body.decode('utf-8', 'replace')}")
        expected = _server_proof(self.credential.key, self.server_nonce, self.nonce)
        if op != wire.Op.AUTH or not hmac.compare_digest(body, expected):
            raise ForbiddenError(f"{self.server} did not prove it knows the cluster secret")

    def body_length(self, header: bytes) -> int:
        length = wire.REPLY.unpack_from(header)[6]
        if length > MAX_REFUSAL:
            raise ProtocolError(f"{self.server}: a handshake frame of {length} bytes")
        return length


async def handshake(sock, credential: Credential | None, server: str) -> None:
    """The peer's handshake on a connected non-blocking socket, plain or TLS (bound it with a timeout)."""
    peer = PeerHandshake(credential, server)
    header = await _recv_exactly(sock, wire.REPLY.size, server)
    answer = peer.respond(header, await _recv_exactly(sock, peer.body_length(header), server))
    if not answer:
        return
    await send_all(sock, answer)
    header = await _recv_exactly(sock, wire.REPLY.size, server)
    peer.check(header + await _recv_exactly(sock, peer.body_length(header), server))


async def _recv_exactly(sock, size: int, server: str) -> bytes:
    """Exactly `size` bytes, and not one more: what follows belongs to the connection's reader."""
    buf = bytearray(size)
    view, got = memoryview(buf), 0
    while got < size:
        try:
            more = sock.recv_into(view[got:])
        except (BlockingIOError, InterruptedError):
            await readable(sock)
            continue
        if not more:
            raise UnavailableError(f"{server} closed the connection during the handshake")
        got += more
    return bytes(buf)


def handshake_blocking(sock, credential: Credential | None, server: str) -> None:
    """The same on a blocking socket (its own timeout bounds each step)."""
    peer = PeerHandshake(credential, server)
    header = _recv_exactly_blocking(sock, wire.REPLY.size, server)
    answer = peer.respond(header, _recv_exactly_blocking(sock, peer.body_length(header), server))
    if not answer:
        return
    sock.sendall(answer)
    header = _recv_exactly_blocking(sock, wire.REPLY.size, server)
    peer.check(header + _recv_exactly_blocking(sock, peer.body_length(header), server))


def _recv_exactly_blocking(sock, size: int, server: str) -> bytes:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise UnavailableError(f"{server} closed the connection during the handshake")
        buf += chunk
    return bytes(buf)


# -- where a process finds its secret or token


def read_token(token_file: str | os.PathLike | None = None, env=None) -> str | None:
    """The token this process was given: --token-file, else $KVPOOL_TOKEN_FILE, else $KVPOOL_TOKEN;
    None when there is none. A file readable by others is refused, as ssh refuses such a key."""
    env = os.environ if env is None else env
    path = token_file or env.get("KVPOOL_TOKEN_FILE")
    if path:
        return _read_file(Path(path))
    return env.get("KVPOOL_TOKEN") or None


def _read_file(path: Path) -> str:
    try:
        info = path.stat()
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"token file {path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}); "
                             f"chmod 600 it")
        with open(path, "rb") as f:
            text = f.read(MAX_SECRET + 1)
    except OSError as exc:
        raise ValueError(f"cannot read token file {path}: {exc.strerror or exc}") from None
    if len(text) > MAX_SECRET:
        raise ValueError(f"token file {path} is larger than {MAX_SECRET} bytes")
    token = text.decode("utf-8", "replace").strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token


def client_credential(token: str | None = None) -> Credential | None:
    """A client's credential: `token` if given ("" for none), else the one its environment holds."""
    if token is None:
        token = read_token()
    return Credential.for_client(token) if token else None


def caller_credential(token: str | None = None) -> Credential | None:
    """What a Client proves: `token` if given ("" for none), else the one its environment holds; a client
    token proves the client role, the cluster secret the member role (an operator's client: only a member
    may drain, kvpool/security/roles.py)."""
    if token is None:
        token = read_token()
    if token and not token.startswith(CLIENT_TOKEN_PREFIX):
        return Credential.for_member(token)
    return client_credential(token)


def write_private(path: str | os.PathLike, text: str) -> None:
    """Write a secret readable by this user only (created 0600, never briefly wider)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.chmod(path, 0o600)


def add_token_argument(parser) -> None:
    parser.add_argument("--token-file", default=None, metavar="PATH",
                        help="file holding the cluster secret (mode 0600; default: $KVPOOL_TOKEN_FILE, else the "
                             "secret in $KVPOOL_TOKEN; none: no peer is authenticated)")


def secret_of(parser, args) -> str | None:
    """The cluster secret a master or node was given (parser.error when it is unreadable or a client token)."""
    try:
        secret = read_token(args.token_file)
        if secret:
            Credential.for_member(secret)
    except ValueError as exc:
        parser.error(str(exc))
    return secret


def warn_if_open(verifier: Verifier, what: str) -> None:
    if verifier.open:
        log.warning("%s runs without a cluster secret: any peer that reaches its port may read, write and "
                    "delete (give --token-file, KVPOOL_TOKEN_FILE or KVPOOL_TOKEN)", what)
