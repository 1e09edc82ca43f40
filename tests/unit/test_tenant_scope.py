"""A tenant's scope, record and node share (kvpool/protocol/tenants.py): pure logic."""

import pytest

from kvpool.protocol import tenants
from kvpool.protocol.tenants import CLIENT_SCOPE, TenantRecord, node_share, scope_of


def test_scope_is_golden():
    # Stored keys outlive a version (SSD files, inventories): the scope's form is fixed.
    scope = scope_of("team-a")
    assert scope.key("blk/1") == "\x01team-a\x01blk/1"
    assert scope.prefix_bytes == b"\x01team-a\x01"
    assert tenants.tenant_of(b"\x01team-a\x01blk/1") == "team-a"
    assert tenants.tenant_of(b"blk/1") == ""


def test_scopes_do_not_overlap():
    a, ab = scope_of("a"), scope_of("ab")
    assert a.holds(a.key("x")) and not a.holds(ab.key("x")) and not ab.holds(a.key("x"))
    assert not CLIENT_SCOPE.holds(a.key("x")) and CLIENT_SCOPE.holds("x")
    assert not a.holds("x") and not a.holds_bytes(b"x") and a.holds_bytes(a.key("x").encode())
    assert CLIENT_SCOPE.holds_all(["x", "y"]) and not CLIENT_SCOPE.holds_all(["x", a.key("y")])
    assert a.holds_all([a.key("x")]) and not a.holds_all([a.key("x"), "y"])


@pytest.mark.parametrize("name", ["", "A", "-a", "a" * 64, "a/b", "a\x01", "é"])
def test_bad_names(name):
    assert tenants.name_problem(name)


def test_record_round_trip_and_checks():
    record = TenantRecord("team-a", version=3, quota=100, reserve=40)
    assert TenantRecord.from_json(record.to_json()) == record
    with pytest.raises(ValueError, match="reserve"):
        TenantRecord.from_json(TenantRecord("b", quota=10, reserve=20).to_json())
    with pytest.raises(ValueError, match="tenant name"):
        TenantRecord.from_json(TenantRecord("B").to_json())


def test_node_shares_add_up_to_the_limits():
    record = TenantRecord("t", quota=1000, quota_dram=300, quota_objects=10, reserve=100)
    pool = (600, 400)
    shares = [node_share(record, (200, 100), pool), node_share(record, (400, 300), pool)]
    assert sum(s.quota for s in shares) == 1000
    assert [s.quota_dram for s in shares] == [100, 200]
    assert all(s.quota_ssd == 0 for s in shares)
    assert node_share(record, (0, 0), pool).quota == 1  # a set limit never rounds down to none
