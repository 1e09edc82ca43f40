"""gRPC call proofs (kvpool/security/grpc_auth.py) and the master's replay cache (replay_cache.py), without
sockets: a proof holds once, for one master, one method and one request; the cache stays bounded under a
flood of valid proofs and still takes fresh ones."""

import pytest

from kvpool.errors import ForbiddenError
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol.tenants import TenantRecord
from kvpool.security import auth
from kvpool.security.grpc_auth import STATS, CallVerifier, MasterName, call_proof, request_digest
from kvpool.security.replay_cache import MAX_AHEAD_MS, WINDOW_MS, ProofRefused, ReplayCache

SECRET = "0123456789abcdef0123456789abcdef"
LEADER, STANDBY = "10.0.0.1:50051", "10.0.0.2:50051"
REMOVE = "/kvpool.Master/Remove"
NOW = 1_700_000_000.0


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def masters(clock):
    verifier = auth.Verifier(SECRET)
    return CallVerifier(verifier, LEADER, clock), CallVerifier(verifier, STANDBY, clock)


def removal(key: str) -> bytes:
    return pb.RemoveRequest(key=key).SerializeToString()


def test_a_proof_holds_once_for_its_master_method_and_request():
    clock = Clock(NOW)
    leader, standby = masters(clock)
    client = auth.Credential.for_client(auth.client_token(SECRET))
    made = int(NOW * 1000)
    proof = call_proof(client, REMOVE, LEADER, removal("k"), made)
    assert leader.check(proof, REMOVE, request_digest(removal("k"))).role is auth.Role.CLIENT
    with pytest.raises(ForbiddenError, match="already used"):
        leader.check(proof, REMOVE, request_digest(removal("k")))
    with pytest.raises(ForbiddenError, match="made for master '10.0.0.1:50051'; this is '10.0.0.2:50051'"):
        standby.check(proof, REMOVE, request_digest(removal("k")))  # captured at the leader, replayed at the standby
    fresh = call_proof(client, REMOVE, LEADER, removal("k"), made)
    with pytest.raises(ForbiddenError, match="another method or request"):
        leader.check(fresh, "/kvpool.Master/RemoveByPrefix", request_digest(removal("k")))
    with pytest.raises(ForbiddenError, match="another method or request"):
        leader.check(fresh, REMOVE, request_digest(removal("other")))
    forged = fresh.replace(LEADER, STANDBY)  # the master named in clear is under the MAC too
    with pytest.raises(ForbiddenError, match="another method or request"):
        standby.check(forged, REMOVE, request_digest(removal("k")))
    assert leader.check(fresh, REMOVE, request_digest(removal("k"))).role is auth.Role.CLIENT


def test_only_stats_may_be_asked_of_any_master():
    leader, standby = masters(Clock(NOW))
    member = auth.Credential.for_member(SECRET)
    empty = pb.StatsRequest().SerializeToString()
    made = int(NOW * 1000)
    assert standby.check(call_proof(member, STATS, "", empty, made), STATS, request_digest(empty)).role is auth.Role.MEMBER
    with pytest.raises(ForbiddenError, match="made for master '\\(any\\)'"):
        leader.check(call_proof(member, REMOVE, "", removal("k"), made), REMOVE, request_digest(removal("k")))


def test_proofs_refused_for_form_token_version_and_clock():
    clock = Clock(NOW)
    leader, _ = masters(clock)
    client = auth.Credential.for_client(auth.client_token(SECRET))
    digest = request_digest(removal("k"))
    with pytest.raises(ForbiddenError, match="needs the cluster token"):
        leader.check(None, REMOVE, digest)
    with pytest.raises(ForbiddenError, match="malformed"):
        leader.check("garbage", REMOVE, digest)
    old_format = "1.100.1700000000.00112233445566778899aabbccddeeff." + "0" * 64  # what version 1 sent
    with pytest.raises(ForbiddenError, match="malformed|version"):
        leader.check(old_format, REMOVE, digest)
    impostor = auth.Credential.for_client(auth.client_token("f" * 32))
    with pytest.raises(ForbiddenError, match="wrong cluster token"):
        leader.check(call_proof(impostor, REMOVE, LEADER, removal("k"), int(NOW * 1000)), REMOVE, digest)
    behind = call_proof(client, REMOVE, LEADER, removal("k"), int(NOW * 1000) - WINDOW_MS - 1)
    with pytest.raises(ForbiddenError, match="before the master's clock"):
        leader.check(behind, REMOVE, digest)
    ahead = call_proof(client, REMOVE, LEADER, removal("k"), int(NOW * 1000) + MAX_AHEAD_MS + 1)
    with pytest.raises(ForbiddenError, match="ahead of the master's clock"):
        leader.check(ahead, REMOVE, digest)
    assert CallVerifier(auth.Verifier(None)).check(None, "/x", b"").role is auth.Role.MEMBER  # an open master


def test_the_proof_format_is_fixed(monkeypatch):
    """Golden values: a proof made by one version is checked by the next (clients and masters upgrade apart)."""
    monkeypatch.setattr("kvpool.security.grpc_auth.secrets.token_hex", lambda _n: "00112233445566778899aabbccddeeff")
    client = auth.Credential.for_client(auth.client_token(SECRET))
    proof = call_proof(client, REMOVE, LEADER, removal("k"), 1_700_000_000_123)
    # version . role . made (ms) . nonce . HMAC-SHA256(client key, "kvpool grpc v2|role|made|nonce|master|method|"
    # + SHA-256 of the serialized request) . master
    assert proof == ("2.1.1700000000123.00112233445566778899aabbccddeeff."
                     "14f14e9e1c0add0f7982533881d673c4b1ae7c9b86097fe6e783753134a5c94f"
                     ".10.0.0.1:50051")
    leader, _ = masters(Clock(1_700_000_000.2))
    assert leader.check(proof, REMOVE, request_digest(removal("k"))).role is auth.Role.CLIENT


def test_a_channel_names_the_master_its_stats_named():
    name = MasterName("localhost:50051")
    member = auth.Credential.for_member(SECRET)
    assert name.proof(member, STATS, pb.StatsRequest()).endswith(".")  # before Stats: for no master in particular
    assert name.proof(member, REMOVE, pb.RemoveRequest(key="k")).endswith(".localhost:50051")  # the address dialled
    name.learned("127.0.0.1:50051")
    assert name.confirmed
    assert name.proof(member, STATS, pb.StatsRequest()).endswith(".127.0.0.1:50051")
    assert name.proof(member, REMOVE, pb.RemoveRequest(key="k")).endswith(".127.0.0.1:50051")


def test_the_replay_cache_stays_bounded_and_takes_fresh_proofs_under_a_flood():
    cache = ReplayCache(capacity=1000)
    now = 1_000_000
    flood = 0
    for step in range(50):  # 50 ms of a flood far faster than any master takes: 200 valid proofs per ms
        for i in range(200):
            cache.take(now, f"flood-{step}-{i}", now)
            flood += 1
        assert len(cache) <= 1000
        cache.take(now, f"honest-{step}", now)  # an honest caller's fresh proof, in the same millisecond
        now += 1
    assert flood == 10_000 and len(cache) == 1000
    with pytest.raises(ProofRefused, match="already used"):
        cache.take(now - 1, "honest-49", now)  # a replay of what is still remembered
    with pytest.raises(ProofRefused, match="not newer than the last one the master forgot"):
        cache.take(now - 40, "honest-10", now)  # a replay of what was dropped: under the floor
    cache.take(now, "honest-next", now)


def test_the_replay_cache_forgets_what_the_window_refuses_anyway():
    cache = ReplayCache(capacity=10)
    for i in range(10):
        cache.take(1000, f"n{i}", 1000)
    later = 1000 + WINDOW_MS + 1
    cache.take(later, "fresh", later)  # the ten are past the window: forgotten, no floor raised
    assert len(cache) == 1 and cache.floor_ms == -1
    with pytest.raises(ProofRefused, match="before the master's clock"):
        cache.take(1000, "n0", later)


def test_a_tenant_proof_names_its_tenant_and_ends_with_its_version():
    verifier = auth.Verifier(SECRET)
    verifier.tenants["team-a"] = TenantRecord("team-a", version=1)
    leader = CallVerifier(verifier, "m1:1")
    tenant = auth.Credential.for_client(auth.tenant_token(SECRET, "team-a", 1))
    body = removal("\x01team-a\x01k")
    caller = leader.check(call_proof(tenant, REMOVE, "m1:1", body), REMOVE, request_digest(body))
    assert caller.role is auth.Role.TENANT and caller.tenant == "team-a"
    # Another tenant's name on this tenant's key proves nothing; nor does a rotated token.
    impostor = auth.Credential(auth.Role.TENANT, tenant.key, "team-b", 1)
    verifier.tenants["team-b"] = TenantRecord("team-b", version=1)
    with pytest.raises(ForbiddenError):
        leader.check(call_proof(impostor, REMOVE, "m1:1", body), REMOVE, request_digest(body))
    verifier.tenants["team-a"] = TenantRecord("team-a", version=2)
    with pytest.raises(ForbiddenError, match="tenant"):
        leader.check(call_proof(tenant, REMOVE, "m1:1", body), REMOVE, request_digest(body))
