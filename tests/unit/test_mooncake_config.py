"""The pure parts of kvpool.compat.mooncake: setup()'s forms, master addresses, ReplicateConfig as put options,
the tensor header (a stored format: golden bytes), registered address ranges and the error codes."""

import ctypes
from types import SimpleNamespace

import pytest

from kvpool import errors
from kvpool.compat.mooncake import codes, config, tensors
from kvpool.compat.mooncake.memory import ALLOCATED, MooncakeHostMemAllocator, RegisteredMemory, UnregisteredMemory


def test_setup_positional_as_mooncake_and_sglang_call_it():
    setup = config.parse(("host-a", "P2PHANDSHAKE", 4 << 30, 16 << 20, "rdma", "mlx5_0", "10.0.0.1:50051"), {})
    assert (setup.local_hostname, setup.master, setup.etcd, setup.tenant_id) == ("host-a", "10.0.0.1:50051", None,
                                                                                "default")
    setup = config.parse(("h", "P2PHANDSHAKE", 0, 0, "tcp", "", "m:1", None), {"tenant_id": "team-a",
                                                                                "enable_ssd_offload": False})
    assert setup.tenant_id == "team-a"
    with pytest.raises(TypeError, match="missing master_server_addr"):
        config.parse(("h", "P2PHANDSHAKE", 0, 0, "tcp", ""), {})
    with pytest.raises(TypeError, match="unexpected keyword"):
        config.parse(("h", "", 0, 0, "tcp", "", "m:1"), {"segment": 1})
    with pytest.raises(TypeError, match="multiple values"):
        config.parse(("h", "", 0, 0, "tcp", "", "m:1"), {"protocol": "tcp"})
    with pytest.raises(ValueError, match="at most"):
        config.parse(tuple(range(14)), {})


def test_setup_dict_with_lmcache_key_names_and_a_kvpool_token():
    setup = config.parse(({"local_hostname": "h", "master_server_address": "m:1", "device_name": "",
                           "global_segment_size": "3355443200", "kvpool_token": "secret", "something_new": 1},), {})
    assert (setup.master, setup.token) == ("m:1", "secret")
    with pytest.raises(ValueError, match="no master_server_addr"):
        config.parse(({"local_hostname": "h"},), {})


@pytest.mark.parametrize("given, expected", [
    ("127.0.0.1:50051", ("127.0.0.1:50051", None)),
    ("a:1;b:2", ("a:1,b:2", None)),
    (" a:1,b:2 ", ("a:1,b:2", None)),
    ("etcd://e:2379", (None, "e:2379")),
    ("etcd://e:2379;f:2379", (None, "e:2379")),
])
def test_master_addresses(given, expected):
    assert config.master_address(given) == expected


@pytest.mark.parametrize("given", ["", "   ", "etcd://", "etcd://;"])
def test_no_master_address_is_an_error_naming_the_forms(given):
    with pytest.raises(ValueError, match="etcd"):
        config.master_address(given)


def test_replicate_config_fields_and_put_options():
    c = config.ReplicateConfig()
    assert (c.replica_num, c.with_hard_pin, c.soft_pin_ttl_ms, c.preferred_segment) == (1, False, None, "")
    assert c.put_options() == {}
    c.replica_num = 3
    c.with_hard_pin = True
    assert c.put_options() == {"replicas": 3, "pin": "hard"}
    soft = config.ReplicateConfig()
    soft.soft_pin_action = config.SoftPinAction.ENABLE
    assert soft.put_options() == {"pin": "soft"}
    soft.soft_pin_ttl_ms = 2500
    assert soft.put_options() == {"pin": "soft", "pin_ttl": 2.5}
    soft.preferred_segment = "node-1:12345"  # accepted, said once, and ignored
    assert soft.put_options() == {"pin": "soft", "pin_ttl": 2.5}
    with pytest.raises(AttributeError):
        c.session_ids = ["s"]  # a field of later Mooncakes: SGLang tests for it with hasattr
    assert "replica_num: 3" in repr(c)


def test_tensor_header_is_the_stored_format():
    fake = SimpleNamespace(dtype="torch.float16", shape=(2, 3))  # what header() reads of a tensor
    assert tensors.header(fake) == bytes.fromhex("4b56505401" "07" + b"float16".hex() + "02"
                                                 "0200000000000000" "0300000000000000")
    assert tensors.header(SimpleNamespace(dtype="torch.bfloat16", shape=())) == b"KVPT\x01\x08bfloat16\x00"


def test_tensors_round_trip_and_other_bytes_are_refused():
    torch = pytest.importorskip("torch")
    for tensor in (torch.arange(6, dtype=torch.int32).reshape(3, 2), torch.zeros(0, 4), torch.tensor(1.5)):
        header, data = tensors.parts(tensor)
        back = tensors.tensor_of(header + bytes(data))
        assert back.dtype == tensor.dtype and back.shape == tensor.shape and torch.equal(back, tensor)
    for junk in (b"", b"KVPT", b"KVPT\x02\x07float16\x00", b"KVPT\x01\x04nope\x00", b"KVPT\x01\x07float16\x02\x01"):
        with pytest.raises(ValueError):
            tensors.tensor_of(junk)


def test_views_only_inside_registered_ranges():
    memory = RegisteredMemory()
    buffer = ctypes.create_string_buffer(b"abcdefgh", 8)
    start = ctypes.addressof(buffer)
    view = memory.register(start, 8)
    assert bytes(view) == b"abcdefgh"
    assert bytes(memory.view(start + 2, 3)) == b"cde" and bytes(memory.view(start + 8, 0)) == b""
    memory.view(start + 1, 1)[0] = ord("B")  # writable: gets land in place
    assert buffer.raw[:3] == b"aBc"
    for address, size in ((start - 1, 2), (start + 7, 2), (start + 9, 1), (0, 1)):
        with pytest.raises(UnregisteredMemory, match="register_buffer"):
            memory.view(address, size)
    with pytest.raises(UnregisteredMemory):
        memory.view(start, -1)
    inner = ctypes.create_string_buffer(b"0123456789", 10)  # an overlapping range: the one holding it answers
    memory.register(ctypes.addressof(inner), 10)
    assert bytes(memory.view(ctypes.addressof(inner) + 9, 1)) == b"9"
    assert memory.unregister(start) and not memory.unregister(start)
    with pytest.raises(UnregisteredMemory):
        memory.view(start, 1)
    with pytest.raises(UnregisteredMemory):
        memory.register(start, 0)


def test_host_allocator_memory_is_registered_while_allocated():
    allocator = MooncakeHostMemAllocator()
    address = allocator.alloc(4096)
    assert address and len(ALLOCATED.view(address, 4096)) == 4096
    assert allocator.free(address) == 0 and allocator.free(address) == -1
    with pytest.raises(UnregisteredMemory):
        ALLOCATED.view(address, 1)
    assert allocator.alloc(0) == 0


@pytest.mark.parametrize("error, code", [
    (errors.KeyNotFoundError("k"), -704), (errors.KeyExistsError("k"), -705), (errors.NoSpaceError("full"), -200),
    (errors.QuotaExceededError("quota"), -200), (errors.ValueTooLargeError("big"), -200),
    (errors.InvalidKeyError("key"), -400), (errors.InvalidArgumentError("arg"), -600),
    (errors.ForbiddenError("token"), -601), (errors.DeadlineExceededError("late"), -900),
    (errors.UnavailableError("down"), -900), (errors.ChecksumMismatchError("bits"), -800),
    (errors.StaleReplicaError("old"), -701), (errors.InternalError("bug"), -1), (ValueError("bad"), -600),
])
def test_kvpool_errors_as_mooncake_codes(error, code):
    assert codes.code_of(error) == code

