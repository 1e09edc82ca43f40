"""kvpool's Mooncake Store client (kvpool.compat.mooncake) against a real cluster: every case of
mooncake_surface.py answers what Mooncake 0.3.13 answered (mooncake_surface.json, recorded from Mooncake itself),
addresses outside registered buffers are refused and never touched, and setup, ReplicateConfig, tenants and
tensors map onto kvpool as docs/mooncake.md says."""

import ctypes
import json
import mmap
from pathlib import Path

import pytest

from kvpool import Client
from kvpool.compat.mooncake import MooncakeDistributedStore, ReplicateConfig
from kvpool.compat.mooncake import codes

import mooncake_surface
from test_replication import replicas_of

pytestmark = pytest.mark.quick

RECORDED = json.loads((Path(__file__).with_name("mooncake_surface.json")).read_text())
# Mooncake leases a key to its readers after every get and lookup (5 s by default) and refuses to remove a
# leased key (-706): kvpool has no read leases (a reader holds what it reads through its version), so a
# remove there succeeds at once. These cases, and only these, answer otherwise, as follows.
WITHOUT_LEASES = {"remove": 0, "remove_missing": -704, "get_after_remove": {"bytes": ""},
                  "batch_remove": [0, -704, 0], "remove_all_leaves_nothing": 0}


@pytest.fixture
def store(cluster):
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", "http://127.0.0.1:8080/metadata", 1 << 30, 16 << 20, "tcp", "",
                       cluster.master_address) == 0
    yield store
    store.close()


def registered(store, size: int = 1 << 20):
    region = mmap.mmap(-1, size)
    address = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert store.register_buffer(address, size) == 0
    return region, address


def test_every_case_answers_as_mooncake_does(store):
    assert set(WITHOUT_LEASES) <= set(RECORDED)
    answers = mooncake_surface.cases(store, "surface")
    assert answers.keys() == RECORDED.keys() - {"close"}
    differing = {name for name in answers if answers[name] != RECORDED[name]}
    assert differing <= set(WITHOUT_LEASES), {name: (answers[name], RECORDED[name]) for name in differing}
    assert {name: answers[name] for name in WITHOUT_LEASES} == WITHOUT_LEASES
    assert store.close() == 0


def test_addresses_outside_registered_buffers_are_refused_and_never_touched(store, client):
    region, address = registered(store, 4096)
    region[:] = b"r" * 4096
    outside = ctypes.create_string_buffer(b"o" * 64, 64)
    outside_address = ctypes.addressof(outside)
    assert store.put_from("mc/outside", outside_address, 64) == codes.INVALID_PARAMS
    assert store.put_from("mc/across-the-end", address + 4000, 200) == codes.INVALID_PARAMS
    assert store.put_from("mc/before-the-start", address - 1, 16) == codes.INVALID_PARAMS
    assert store.batch_put_from(["mc/b0", "mc/b1"], [address, outside_address], [16, 16]) == [codes.INVALID_PARAMS] * 2
    assert client.batch_exists(["mc/outside", "mc/across-the-end", "mc/before-the-start", "mc/b0", "mc/b1"]) == \
        [False] * 5
    assert store.put("mc/value", b"v" * 64) == 0
    assert store.get_into("mc/value", outside_address, 64) == codes.INVALID_PARAMS
    assert store.batch_get_into(["mc/value"], [address + 4090], [64]) == [codes.INVALID_PARAMS]
    assert outside.raw == b"o" * 64 and region[:] == b"r" * 4096
    assert store.get_into("mc/value", address, 64) == 64 and region[:64] == b"v" * 64
    assert store.unregister_buffer(address) == 0
    assert store.get_into("mc/value", address, 64) == codes.INVALID_PARAMS  # no longer registered
    assert store.register_buffer(0, 64) == codes.INVALID_PARAMS
    assert store.register_buffer(address, 0) == codes.INVALID_PARAMS


def test_batches_with_missing_keys_and_several_buffers_per_key(store):
    region, address = registered(store)
    region[:3000] = bytes(i % 251 for i in range(3000))
    assert store.batch_put_from_multi_buffers(["mc/m0", "mc/m1"], [[address, address + 1000], [address + 2000]],
                                              [[1000, 500], [1000]]) == [0, 0]
    assert store.get("mc/m0") == bytes(region[:1000]) + bytes(region[1000:1500])
    out = 1 << 19
    assert store.batch_get_into_multi_buffers(["mc/m0", "mc/missing", "mc/m1"],
                                              [[address + out, address + out + 700], [address + out + 2000],
                                               [address + out + 3000]],
                                              [[700, 800], [100], [1000]]) == [1500, codes.OBJECT_NOT_FOUND, 1000]
    assert region[out:out + 1500] == region[:1000] + region[1000:1500]
    assert region[out + 3000:out + 4000] == region[2000:3000]
    assert store.batch_get_buffer(["mc/missing"]) == [None]
    assert store.get_batch([]) == [] and store.batch_is_exist([]) == []


def test_setup_forms_and_what_they_name(cluster):
    for form in ({"local_hostname": "host-a", "metadata_server": "P2PHANDSHAKE", "protocol": "rdma",
                  "master_server_address": cluster.master_address},  # LMCache's key for the master
                 {"local_hostname": "host-a", "master_server_addr": f"etcd://{cluster.etcd_endpoint}"}):
        store = MooncakeDistributedStore()
        assert store.setup(form) == 0
        assert store.get_hostname() == "host-a" and store.health_check() == 0
        assert store.put("mc/setup", b"x") == 0 and store.is_exist("mc/setup") == 1
        assert store.close() == 0 and store.health_check() == 1
        assert store.is_exist("mc/setup") == codes.INVALID_PARAMS  # closed: every call answers an error
    # SGLang's positional form, with its transfer engine and keywords
    store = MooncakeDistributedStore()
    assert store.setup("h", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master_address, None,
                       enable_ssd_offload=False) == 0
    assert store.setup("h", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", cluster.master_address) == codes.INVALID_PARAMS
    store.close()
    assert MooncakeDistributedStore().setup({"local_hostname": "h"}) == codes.INVALID_PARAMS  # no master named
    assert MooncakeDistributedStore().setup("h", "", 0, 0, "tcp", "", "not an address") == codes.INVALID_PARAMS
    with pytest.raises(TypeError, match="missing"):
        MooncakeDistributedStore().setup("h", "P2PHANDSHAKE", 0)
    assert MooncakeDistributedStore().get("mc/setup") == b""  # never set up: misses, logged
    with pytest.raises(AttributeError, match="docs/mooncake.md"):
        MooncakeDistributedStore().create_copy_task("k", ["seg"])


def test_a_tenant_named_in_setup_must_be_the_tokens(cluster):
    token = cluster.add_tenant("team-mc")
    store = MooncakeDistributedStore()
    assert store.setup({"local_hostname": "h", "master_server_addr": cluster.master_address,
                        "tenant_id": "team-other", "kvpool_token": token}) == codes.ILLEGAL_CLIENT
    assert store.setup({"local_hostname": "h", "master_server_addr": cluster.master_address,
                        "tenant_id": "team-mc", "kvpool_token": token}) == 0
    try:
        assert store.put("mc/tenant", b"theirs") == 0
        with Client(cluster.master_address, token=token) as theirs, Client(cluster.master_address) as plain:
            assert theirs.get("mc/tenant") == b"theirs" and not plain.exists("mc/tenant")
    finally:
        store.close()
    assert MooncakeDistributedStore().setup("h", "", 0, 0, "tcp", "", cluster.master_address,
                                            tenant_id="team-mc") == codes.ILLEGAL_CLIENT  # the cluster's token


def test_replicate_config_becomes_kvpool_put_options(store, cluster):
    replicated = ReplicateConfig()
    replicated.replica_num = 2
    replicated.with_hard_pin = True
    assert store.put("mc/two", b"2" * 1000, replicated) == 0
    region, address = registered(store)  # kept alive while the store may read it, as with Mooncake
    assert store.batch_put_from(["mc/two-b"], [address], [64], replicated) == [0]
    for key in ("mc/two", "mc/two-b"):
        copies = replicas_of(cluster, key)
        assert len({c.node_id for c in copies}) == 2
    assert store.put("mc/one", b"1" * 1000) == 0 and len(replicas_of(cluster, "mc/one")) == 1
    with pytest.raises(AttributeError):
        replicated.not_a_field = 1
    too_many = ReplicateConfig()
    too_many.replica_num = 0
    assert store.put("mc/none", b"x", too_many) == codes.INVALID_PARAMS


def test_tensors_round_trip_with_dtype_and_shape(store):
    torch = pytest.importorskip("torch")
    tensors = [torch.arange(24, dtype=torch.float32).reshape(2, 3, 4), torch.ones(5, dtype=torch.bfloat16) / 3,
               torch.arange(10, dtype=torch.int64)[::2]]  # not contiguous
    assert store.put_tensor("mc/t0", tensors[0]) == 0
    assert store.batch_put_tensor(["mc/t1", "mc/t2"], tensors[1:]) == [0, 0]
    got = [store.get_tensor("mc/t0"), *store.batch_get_tensor(["mc/t1", "mc/t2", "mc/t-missing"])]
    for mine, theirs in zip(got, tensors):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape and torch.equal(mine, theirs)
    assert got[3] is None
    assert store.put("mc/not-a-tensor", b"plain bytes") == 0 and store.get_tensor("mc/not-a-tensor") is None


def test_a_pool_without_room_answers_no_available_handle(store):
    assert store.put("mc/huge", bytearray(400 << 20)) == codes.NO_AVAILABLE_HANDLE  # larger than any node
    assert store.is_exist("mc/huge") == 0
