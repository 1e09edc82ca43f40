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
import string
import time
from dataclasses import dataclass
from enum import IntFlag
from pathlib import Path

from ..protocol import wire
from ..protocol.tenants import MAX_NAME, TenantRecord, name_problem, scope_of
from ..errors import Code, ForbiddenError, ProtocolError, UnavailableError, error_for
from ..sockets.socket_input import readable
from ..sockets.socket_output import send_all
from .roles import CLIENT, MEMBER, Caller, Role  # noqa: F401 - also imported from here

log = logging.getLogger(__name__)

CLIENT_TOKEN_PREFIX = "kvpool-client-v1:"
TENANT_TOKEN_PREFIX = "kvpool-tenant-v1:"  # then NAME:VERSION:KEY (64 hex digits)
MAX_IDENT = MAX_NAME + 21  # bytes of a tenant's "NAME:VERSION" in its AUTH frame
NONCE = 32  # bytes of each side's nonce
PROOF = 32  # bytes of an HMAC-SHA256
MAX_REFUSAL = 8192  # longest AUTH reply a peer reads (a proof, or an error message)
MAX_SECRET = 4096  # bytes of a secret or token file
MIN_SECRET_BITS = 128  # what a cluster secret must hold where one enters a server or a command (secret_problem)
_KEY_HEX = 64  # hex digits of a client token's key (an HMAC-SHA256)
_BASE64 = frozenset(string.ascii_letters + string.digits + "+/-_=")


class ChallengeFlag(IntFlag):
    OPEN = 1  # the server has no secret: it takes any peer, and proves nothing


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, b"kvpool key v1 " + purpose, hashlib.sha256).digest()


def placement_key(secret: str) -> bytes:
    """The key of the leader's seals over placements (placement_seal.py): members only."""
    return _derive(secret.encode(), b"placement")


def new_secret() -> str:
    return secrets.token_hex(32)


def secret_bits(secret: str) -> int:
    """About how many bits `secret` holds, from its length and the characters it draws on (hex: 4 a
    character, base64: 6, anything else: 6.5, the printable ASCII's): a bound, not a measure of a
    human-chosen one."""
    per = 4 if all(c in string.hexdigits for c in secret) else 6 if all(c in _BASE64 for c in secret) else 6.5
    return int(len(secret) * per)


def secret_problem(token: str) -> str | None:
    """Why `token` (a cluster secret or a client token) may not be used, or None: a secret of fewer than
    MIN_SECRET_BITS bits, or a client token not of the form `kvpool token client` prints."""
    if token.startswith(CLIENT_TOKEN_PREFIX):
        key = token[len(CLIENT_TOKEN_PREFIX):]
        if len(key) != _KEY_HEX or not all(c in string.hexdigits for c in key):
            return (f"malformed client token (expected {CLIENT_TOKEN_PREFIX} and {_KEY_HEX} hex digits): "
                    "make it with `kvpool token client`")
        return None
    if token.startswith(TENANT_TOKEN_PREFIX):
        try:
            parse_tenant_token(token)
        except ValueError as exc:
            return str(exc)
        return None
    bits = secret_bits(token)
    if bits < MIN_SECRET_BITS:
        return (f"the cluster secret holds about {bits} bits, fewer than {MIN_SECRET_BITS}: make one with "
                "`kvpool token new` (64 hex digits)")
    return None


def checked_secret(token: str, source: str) -> str:
    """`token` if it may be used (secret_problem), else ValueError naming `source`, where it came from."""
    problem = secret_problem(token)
    if problem:
        raise ValueError(f"{source}: {problem}")
    return token


def client_token(secret: str) -> str:
    """The credential to give clients: proves the client role, cannot be turned into the member's."""
    return CLIENT_TOKEN_PREFIX + _derive(secret.encode(), b"client").hex()


def tenant_key(secret: str, name: str, version: int) -> bytes:
    """The key of version `version` of tenant `name`'s token: only a holder of the secret can make it, and a
    rotation (a new version) makes another."""
    return _derive(secret.encode(), f"tenant\x00{name}\x00{version}".encode())


def tenant_token(secret: str, name: str, version: int) -> str:
    """The credential to give tenant `name` (version `version` of its record)."""
    return f"{TENANT_TOKEN_PREFIX}{name}:{version}:{tenant_key(secret, name, version).hex()}"


def parse_tenant_token(token: str) -> tuple[str, int, bytes]:
    """(name, version, key) of a tenant token; ValueError saying what is wrong with it."""
    malformed = (f"malformed tenant token (expected {TENANT_TOKEN_PREFIX}NAME:VERSION:KEY): "
                 "make it with `kvpool tenant create` or `kvpool tenant rotate`")
    try:
        name, version, key = token[len(TENANT_TOKEN_PREFIX):].split(":")
        if name_problem(name) or not version.isdigit() or len(key) != _KEY_HEX:
            raise ValueError
        return name, int(version), bytes.fromhex(key)
    except ValueError:
        raise ValueError(malformed) from None


def client_token_of(token: str) -> str:
    """The client token `token` stands for: itself if it is one, else the one the secret `token` makes."""
    return token if token.startswith((CLIENT_TOKEN_PREFIX, TENANT_TOKEN_PREFIX)) else client_token(token)


def object_tier_key(token: str) -> bytes:
    """The key of the object tier's encryption (kvpool/objectstore/sealing.py) from the cluster secret or the
    client token (members and direct readers derive the same one); ValueError for a tenant's token: tenants
    read the tier through the nodes."""
    client = client_token_of(token)
    if not client.startswith(CLIENT_TOKEN_PREFIX):
        raise ValueError("a tenant's token cannot read the encrypted object tier: tenants read it through the nodes")
    return _derive(bytes.fromhex(client[len(CLIENT_TOKEN_PREFIX):]), b"object tier")


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an HTTP Authorization header presents `token` as its bearer token (compared in constant time)."""
    return hmac.compare_digest((header or "").encode(), f"Bearer {token}".encode())


@dataclass(frozen=True)
class Credential:
    """What this process proves when it connects."""

    role: Role
    key: bytes
    tenant: str = ""  # a tenant's credential: its name and token version
    version: int = 0

    @property
    def ident(self) -> bytes:
        """What the AUTH frame names besides the role: a tenant's NAME:VERSION (b"" for the others)."""
        return f"{self.tenant}:{self.version}".encode() if self.tenant else b""

    @classmethod
    def for_client(cls, token: str) -> "Credential":
        """A client's credential from its token: a client token, a tenant's, or the cluster secret itself."""
        if token.startswith(TENANT_TOKEN_PREFIX):
            name, version, key = parse_tenant_token(token)
            return cls(Role.TENANT, key, name, version)
        if token.startswith(CLIENT_TOKEN_PREFIX):
            try:
                key = bytes.fromhex(token[len(CLIENT_TOKEN_PREFIX):])
            except ValueError:
                raise ValueError("malformed client token (expected kvpool-client-v1:<hex>)") from None
            return cls(Role.CLIENT, key)
        return cls(Role.CLIENT, _derive(token.encode(), b"client"))

    @classmethod
    def for_member(cls, secret: str) -> "Credential":
        if secret.startswith((CLIENT_TOKEN_PREFIX, TENANT_TOKEN_PREFIX)):
            raise ValueError("a client token was given where the cluster secret is needed "
                             "(masters and storage nodes take the secret itself)")
        return cls(Role.MEMBER, _derive(secret.encode(), b"member"))


class Verifier:
    """A server's side: the keys of both roles, made from the cluster secret (None: open server), and of
    each tenant's current token (`tenants`: name -> TenantRecord, kept from etcd by
    kvpool/cluster/tenant_directory.py; a tenant absent, or a token of another version, proves nothing)."""

    def __init__(self, secret: str | None):
        self.open = not secret
        if secret and secret.startswith((CLIENT_TOKEN_PREFIX, TENANT_TOKEN_PREFIX)):
            raise ValueError("a client token was given where the cluster secret is needed")
        self._secret = secret
        self.keys = {} if self.open else {Role.CLIENT: _derive(secret.encode(), b"client"),
                                          Role.MEMBER: _derive(secret.encode(), b"member")}
        self.placement_key = None if self.open else placement_key(secret)  # checks the leader's seals
        self.tenants: dict[str, TenantRecord] = {}
        self._tenant_keys: dict[tuple[str, int], bytes] = {}  # made once per (name, version) taken

    def key(self, role: int) -> bytes | None:
        return self.keys.get(role)

    def current(self, caller: Caller) -> bool:
        """Whether `caller` still proves what it did: a tenant's token version is still its record's."""
        if caller.role is not Role.TENANT:
            return True
        record = self.tenants.get(caller.tenant)
        return record is not None and record.version == caller.version

    def caller_key(self, role: int, ident: bytes) -> tuple[Caller, bytes] | None:
        """(the caller, the key its proof must be made with) for an AUTH naming `role` and `ident`; None
        when that proves nothing here (no such role, tenant or version)."""
        if role == Role.TENANT:
            if self.open or len(ident) > MAX_IDENT:
                return None
            name, _, version = ident.decode("ascii", "replace").partition(":")
            record = self.tenants.get(name)
            if record is None or not version.isdigit() or int(version) != record.version:
                return None
            key = self._tenant_keys.get((name, record.version))
            if key is None:
                if len(self._tenant_keys) > 4 * len(self.tenants) + 64:  # rotated or deleted ones
                    self._tenant_keys.clear()
                key = self._tenant_keys[(name, record.version)] = tenant_key(self._secret, name, record.version)
            return Caller(Role.TENANT, scope_of(name), record.version), key
        if ident:
            return None
        key = self.keys.get(role)
        if key is None:
            return None
        return (MEMBER if role == Role.MEMBER else CLIENT), key


def _proof(key: bytes, role: int, server_nonce: bytes, peer_nonce: bytes, ident: bytes = b"") -> bytes:
    return hmac.new(key, b"kvpool peer v1" + bytes([role]) + server_nonce + peer_nonce + ident,
                    hashlib.sha256).digest()


def _server_proof(key: bytes, server_nonce: bytes, peer_nonce: bytes) -> bytes:
    return hmac.new(key, b"kvpool server v1" + server_nonce + peer_nonce, hashlib.sha256).digest()


# -- the server's side, without I/O


class ServerHandshake:
    """One connection's handshake at a server: challenge() first, then answer() with the peer's AUTH."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.nonce = secrets.token_bytes(NONCE)
        self.key = b""

    def challenge(self) -> bytes:
        flags = ChallengeFlag.OPEN if self.verifier.open else 0
        return wire.pack_reply(wire.Op.AUTH, 0, Code.OK, NONCE, 0, flags) + self.nonce

    def answer(self, op: int, req_id: int, ident: bytes, role: int, length: int, payload: bytes) -> tuple[Caller, bytes]:
        """(the caller proved, the OK reply to send) for a peer's first frame (`ident`: its key bytes, a
        tenant's NAME:VERSION); ForbiddenError if it proves nothing (its message is for the peer: send it,
        then close)."""
        if op != wire.Op.AUTH:
            raise ForbiddenError("authenticate first: this server needs the cluster token "
                                 "(KVPOOL_TOKEN_FILE or KVPOOL_TOKEN)")
        if length != NONCE + PROOF or len(payload) != length:
            raise ForbiddenError("malformed AUTH frame")
        found = self.verifier.caller_key(role, ident)
        peer_nonce, proof = payload[:NONCE], payload[NONCE:]
        if found is None or not hmac.compare_digest(proof, _proof(found[1], role, self.nonce, peer_nonce, ident)):
            raise ForbiddenError("wrong cluster token" if role != Role.TENANT else
                                 "wrong tenant token (rotated, deleted, or never made)")
        caller, key = found
        self.key = key  # what the connection proved with (a UCX ticket it is handed is bound to it)
        reply = wire.pack_reply(wire.Op.AUTH, req_id, Code.OK, PROOF) + _server_proof(key, self.nonce, peer_nonce)
        return caller, reply


class Tickets:
    """One-use tickets a server hands out on authenticated connections (in HELLO), so that a transport
    with no handshake of its own (UCX's CONNECT) can be proved with one: an HMAC over a ticket, never
    the key. A ticket carries who it was handed to (the caller and its key): the connection it proves is
    theirs. Bounded: at most MAX outstanding, each for TTL seconds."""

    TTL = 60.0
    MAX = 4096

    def __init__(self, clock=None):
        self.clock = clock or time.monotonic
        self._due: dict[bytes, tuple[float, Caller, bytes]] = {}  # ticket -> (expiry, caller, key), oldest first

    def issue(self, caller: Caller = CLIENT, key: bytes = b"") -> bytes:
        now = self.clock()
        while self._due and (len(self._due) >= self.MAX or next(iter(self._due.values()))[0] <= now):
            del self._due[next(iter(self._due))]
        ticket = secrets.token_bytes(NONCE)
        self._due[ticket] = (now + self.TTL, caller, key)
        return ticket

    def take(self, ticket: bytes) -> tuple[Caller, bytes] | None:
        """(the caller it was handed to, its key) if the ticket is outstanding and in time; used up."""
        entry = self._due.pop(ticket, None)
        if entry is None or entry[0] <= self.clock():
            return None
        return entry[1], entry[2]


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
        if magic == wire.MAGIC and version != wire.VERSION:
            raise wire.version_mismatch(self.server, version)
        if magic != wire.MAGIC:
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
        role, key, ident = self.credential.role, self.credential.key, self.credential.ident
        proof = _proof(key, role, self.server_nonce, self.nonce, ident)
        return wire.REQUEST.pack(wire.MAGIC, wire.VERSION, wire.Op.AUTH, 0, len(ident), role, 0, 0,
                                 NONCE + PROOF, 0) + ident + self.nonce + proof

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
    None when there is none. A file readable by others is refused, as ssh refuses such a key, and so is a
    secret weaker than MIN_SECRET_BITS (secret_problem): this is where a token enters a process."""
    env = os.environ if env is None else env
    path = token_file or env.get("KVPOOL_TOKEN_FILE")
    if path:
        return checked_secret(_read_file(Path(path)), f"token file {path}")
    token = env.get("KVPOOL_TOKEN")
    return checked_secret(token, "$KVPOOL_TOKEN") if token else None


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
    if token and not token.startswith((CLIENT_TOKEN_PREFIX, TENANT_TOKEN_PREFIX)):
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
