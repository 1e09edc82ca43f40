"""The credential logic of kvpool/security/auth.py, without sockets (gRPC call proofs: test_call_proofs.py)."""

import os
import stat

import pytest

from kvpool.protocol.tenants import TenantRecord
from kvpool.security import auth
from kvpool.protocol import wire
from kvpool.errors import Code, ForbiddenError, ProtocolError, UnavailableError

SECRET = "correct horse battery staple"
GOLDEN_TENANT_KEY_START = "a55c552ff4e61814"  # HMAC-SHA256(secret, "kvpool key v1 tenant\\0team-a\\01")


def handshake(credential, verifier, server_nonce_mutation=None):
    """Both sides of one handshake; returns the role the server granted."""
    return handshake_caller(credential, verifier).role


def handshake_caller(credential, verifier):
    """Both sides of one handshake; returns the caller the server granted."""
    server = auth.ServerHandshake(verifier)
    peer = auth.PeerHandshake(credential, "test server")
    challenge = server.challenge()
    answer = peer.respond(challenge[:wire.REPLY.size], challenge[wire.REPLY.size:])
    _m, _v, op, req_id, key_len, role, _g, _a, length, _c = wire.REQUEST.unpack_from(answer)
    body = answer[wire.REQUEST.size:]
    granted, reply = server.answer(op, req_id, body[:key_len], role, length, body[key_len:])
    peer.check(reply)
    return granted


def test_each_credential_proves_its_own_role_and_the_peer_checks_the_server():
    verifier = auth.Verifier(SECRET)
    assert handshake(auth.Credential.for_member(SECRET), verifier) is auth.Role.MEMBER
    assert handshake(auth.Credential.for_client(auth.client_token(SECRET)), verifier) is auth.Role.CLIENT
    # A client given the secret itself still proves only the client role.
    assert handshake(auth.Credential.for_client(SECRET), verifier) is auth.Role.CLIENT


def test_a_client_token_cannot_claim_the_member_role_or_serve_as_the_secret():
    token = auth.client_token(SECRET)
    client = auth.Credential.for_client(token)
    forged = auth.Credential(auth.Role.MEMBER, client.key)  # the client key, sent as a member's
    with pytest.raises(ForbiddenError, match="wrong cluster token"):
        handshake(forged, auth.Verifier(SECRET))
    with pytest.raises(ValueError, match="client token"):
        auth.Credential.for_member(token)
    with pytest.raises(ValueError, match="client token"):
        auth.Verifier(token)


def test_wrong_secret_is_refused_and_an_impostor_server_is_caught():
    with pytest.raises(ForbiddenError, match="wrong cluster token"):
        handshake(auth.Credential.for_client(auth.client_token("other")), auth.Verifier(SECRET))
    # A server that does not know the secret cannot make the proof the peer checks.
    server = auth.ServerHandshake(auth.Verifier("impostor"))
    peer = auth.PeerHandshake(auth.Credential.for_member(SECRET), "impostor")
    challenge = server.challenge()
    peer.respond(challenge[:wire.REPLY.size], challenge[wire.REPLY.size:])
    fake = wire.pack_reply(wire.Op.AUTH, 0, Code.OK, auth.PROOF) + os.urandom(auth.PROOF)
    with pytest.raises(ForbiddenError, match="did not prove"):
        peer.check(fake)


def test_a_proof_is_bound_to_its_challenge():
    verifier = auth.Verifier(SECRET)
    first, second = auth.ServerHandshake(verifier), auth.ServerHandshake(verifier)
    peer = auth.PeerHandshake(auth.Credential.for_member(SECRET), "s")
    challenge = first.challenge()
    answer = peer.respond(challenge[:wire.REPLY.size], challenge[wire.REPLY.size:])
    _m, _v, op, req_id, key_len, role, _g, _a, length, _c = wire.REQUEST.unpack_from(answer)
    with pytest.raises(ForbiddenError):  # replayed to another connection (another nonce)
        second.answer(op, req_id, b"", role, length, answer[wire.REQUEST.size:])


def test_first_frame_must_be_a_well_formed_auth():
    server = auth.ServerHandshake(auth.Verifier(SECRET))
    with pytest.raises(ForbiddenError, match="authenticate first"):
        server.answer(wire.Op.READ, 1, b"", 0, 0, b"")
    with pytest.raises(ForbiddenError, match="malformed"):
        server.answer(wire.Op.AUTH, 1, b"", 2, 10, b"x" * 10)
    with pytest.raises(ForbiddenError):
        server.answer(wire.Op.AUTH, 1, b"", 99, auth.NONCE + auth.PROOF, b"x" * (auth.NONCE + auth.PROOF))


def test_open_servers_and_peers_without_credentials():
    open_challenge = auth.ServerHandshake(auth.Verifier(None)).challenge()
    header, body = open_challenge[:wire.REPLY.size], open_challenge[wire.REPLY.size:]
    assert auth.PeerHandshake(None, "s").respond(header, body) == b""
    with pytest.raises(ForbiddenError, match="without a cluster secret"):  # a peer with a token wants proof
        auth.PeerHandshake(auth.Credential.for_member(SECRET), "s").respond(header, body)
    closed = auth.ServerHandshake(auth.Verifier(SECRET)).challenge()
    with pytest.raises(ForbiddenError, match="needs the cluster token"):
        auth.PeerHandshake(None, "s").respond(closed[:wire.REPLY.size], closed[wire.REPLY.size:])


def test_a_server_that_turns_the_peer_away_or_speaks_another_protocol():
    away = wire.pack_error(wire.TURNED_AWAY, 0, Code.UNAVAILABLE, "node at its limit")
    with pytest.raises(UnavailableError, match="limit"):
        auth.PeerHandshake(None, "s").respond(away[:wire.REPLY.size], away[wire.REPLY.size:])
    with pytest.raises(ProtocolError):
        auth.PeerHandshake(None, "s").respond(b"HTTP/1.1 400 Bad Request\r\n\r\n"[:wire.REPLY.size], b"")


def test_token_sources_and_file_modes(tmp_path, monkeypatch):
    path = tmp_path / "secret"
    auth.write_private(path, SECRET)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert auth.read_token(path, env={}) == SECRET
    assert auth.read_token(None, env={"KVPOOL_TOKEN_FILE": str(path), "KVPOOL_TOKEN": "ignored"}) == SECRET
    assert auth.read_token(None, env={"KVPOOL_TOKEN": SECRET}) == SECRET
    assert auth.read_token(None, env={}) is None
    path.chmod(0o644)
    with pytest.raises(ValueError, match="open to other users"):
        auth.read_token(path, env={})
    empty = tmp_path / "empty"
    auth.write_private(empty, "")
    with pytest.raises(ValueError, match="empty"):
        auth.read_token(empty, env={})
    with pytest.raises(ValueError, match="cannot read"):
        auth.read_token(tmp_path / "missing", env={})


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_ucx_tickets_are_one_use_short_lived_and_bounded():
    clock = Clock(100.0)
    tickets = auth.Tickets(clock=clock)
    first = tickets.issue()
    assert tickets.take(first) and not tickets.take(first)  # once
    late = tickets.issue()
    clock.now += auth.Tickets.TTL + 1
    assert not tickets.take(late)  # expired
    many = [tickets.issue() for _ in range(auth.Tickets.MAX + 10)]
    assert len(tickets._due) == auth.Tickets.MAX  # the oldest gave way
    assert not tickets.take(many[0]) and tickets.take(many[-1])
    key = auth.Credential.for_client(SECRET).key
    assert auth.ticket_proof(key, 1, first, b"worker-a") != auth.ticket_proof(key, 1, first, b"worker-b")


def test_engine_options_take_the_token_from_a_file(tmp_path):
    from kvpool.connectors.client_settings import CONNECTOR_TIMEOUT, client_settings
    from kvpool.errors import InvalidArgumentError

    path = tmp_path / "client.token"
    auth.write_private(path, auth.client_token(SECRET))
    settings = client_settings({"master": "h:1", "token_file": str(path), "tls_ca": "/ca.pem"}, "in test")
    assert settings == {"address": "h:1", "token": auth.client_token(SECRET), "tls_ca": "/ca.pem",
                        "timeout": CONNECTOR_TIMEOUT}
    with pytest.raises(InvalidArgumentError, match="in test"):
        client_settings({"master": "h:1", "token_file": str(tmp_path / "missing")}, "in test")


def test_a_tenant_token_proves_its_tenant_while_its_version_is_current():
    verifier = auth.Verifier(SECRET)
    token = auth.tenant_token(SECRET, "team-a", 2)
    credential = auth.Credential.for_client(token)
    assert (credential.role, credential.tenant, credential.version) == (auth.Role.TENANT, "team-a", 2)
    with pytest.raises(ForbiddenError, match="tenant token"):  # no such tenant (yet)
        handshake(credential, verifier)
    verifier.tenants["team-a"] = TenantRecord("team-a", version=2)
    caller = handshake_caller(credential, verifier)
    assert caller.role is auth.Role.TENANT and caller.scope.prefix == "\x01team-a\x01" and caller.version == 2
    assert verifier.current(caller)
    verifier.tenants["team-a"] = TenantRecord("team-a", version=3)  # rotated
    assert not verifier.current(caller)
    with pytest.raises(ForbiddenError, match="tenant token"):
        handshake(credential, verifier)
    # A tenant's key under another tenant's name, or another version, proves nothing.
    verifier.tenants["team-b"] = TenantRecord("team-b", version=3)
    forged = auth.Credential(auth.Role.TENANT, auth.tenant_key(SECRET, "team-a", 3), "team-b", 3)
    with pytest.raises(ForbiddenError):
        handshake(forged, verifier)
    # Nor does a client token claiming a tenant, or a tenant key claiming the client role.
    with pytest.raises(ForbiddenError):
        handshake(auth.Credential(auth.Role.CLIENT, auth.tenant_key(SECRET, "team-b", 3)), verifier)
    assert handshake(auth.Credential.for_client(auth.tenant_token(SECRET, "team-b", 3)), verifier) is auth.Role.TENANT


def test_tenant_token_is_golden_and_checked():
    # A token outlives a version of the software: its form and key derivation are fixed.
    token = auth.tenant_token("0" * 64, "team-a", 1)
    assert token == ("kvpool-tenant-v1:team-a:1:"
                     + auth.tenant_key("0" * 64, "team-a", 1).hex())
    assert auth.tenant_key("0" * 64, "team-a", 1).hex().startswith(GOLDEN_TENANT_KEY_START)
    assert auth.secret_problem(token) is None
    assert "malformed tenant token" in auth.secret_problem("kvpool-tenant-v1:Team:1:" + "0" * 64)
    assert "malformed tenant token" in auth.secret_problem("kvpool-tenant-v1:team:x:" + "0" * 64)
    with pytest.raises(ValueError, match="client token"):
        auth.Verifier(token)
