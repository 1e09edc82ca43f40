"""Put options, hold values and lz4 compression as the client resolves them, before any RPC."""

import asyncio
import inspect

import numpy as np
import pytest

from kvpool import AsyncClient, Client
from kvpool.protocol.checksum import checksum
from kvpool.client import compression, put_options, writes
from kvpool.client.reads import decoded as _decoded, landing as _landing
from kvpool.errors import ChecksumMismatchError, InvalidArgumentError
from kvpool.proto import kvpool_pb2 as pb
from kvpool.protocol.wire import WRITE_OPTIONS, WriteFlag
from kvpool.protocol.write_options import NO_OPTIONS

TOKENS = np.tile(np.arange(1000, 1064, dtype=np.uint32), 4096).tobytes()  # 1 MiB of repeating token ids


# -- compression

@pytest.mark.parametrize("value", [b"x", b"abc" * 7, TOKENS, bytes(range(256)) * 3])
def test_forced_compression_round_trips(value):
    packed = compression.encode(memoryview(value), True, None)
    assert packed is not None
    assert compression.decode(packed, len(value), "k") == value


def test_compressible_values_shrink():
    packed = compression.encode(memoryview(TOKENS), True, None)
    assert len(packed) * 20 < len(TOKENS)


def test_policy_compresses_only_large_values_that_shrink():
    big, small = memoryview(TOKENS), memoryview(TOKENS[:100])
    random = memoryview(np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes())
    assert compression.encode(big, None, None) is None  # no policy, not asked
    assert compression.encode(big, None, 4096) is not None
    assert compression.encode(small, None, 4096) is None  # not above the threshold
    assert compression.encode(small, None, 100) is None  # "above" is strict
    assert compression.encode(random, None, 0) is None  # would not shrink
    assert compression.encode(random, True, None) is not None  # asked for: compressed anyway
    assert compression.encode(big, False, 0) is None  # a put's compress=False beats the policy
    assert compression.encode(memoryview(b""), True, None) is None  # nothing to compress


def test_corrupt_or_mis_sized_compressed_bytes_are_refused():
    packed = bytes(compression.encode(memoryview(TOKENS), True, None))
    with pytest.raises(ChecksumMismatchError, match="decompress"):
        compression.decode(memoryview(packed[:-7]), len(TOKENS), "k")
    with pytest.raises(ChecksumMismatchError):
        compression.decode(memoryview(packed), len(TOKENS) + 1, "k")  # raw size the metadata claims is wrong


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True])
def test_bad_compress_settings(bad):
    with pytest.raises(InvalidArgumentError, match="compress_above"):
        compression.check_threshold(bad)
    with pytest.raises(InvalidArgumentError, match="compress_above"):
        AsyncClient("127.0.0.1:1", compress_above=bad)
    if not isinstance(bad, bool):
        with pytest.raises(InvalidArgumentError, match="compress must be"):
            compression.encode(memoryview(b"abc"), bad, None)


# -- get side: where stored bytes land and how callers get the raw value

def _info(stored: bytes, raw_size: int, compressed: bool) -> pb.ObjectInfo:
    return pb.ObjectInfo(key="k", size=len(stored), checksum=checksum(stored), generation=1,
                         compressed=compressed, raw_size=raw_size)


def test_compressed_value_is_decompressed_into_the_callers_buffer():
    stored = bytes(compression.encode(memoryview(TOKENS), True, None))
    info = _info(stored, len(TOKENS), True)
    dest = memoryview(bytearray(len(TOKENS) + 10))
    landing = _landing(info, dest)
    assert landing.obj is dest.obj and len(landing) == len(stored)  # received into dest itself
    landing[:] = stored
    value = _decoded(info, landing, dest, "k")
    assert bytes(value) == TOKENS and value.obj is dest.obj
    # get(): a new bytes object of the raw value
    fresh = _landing(info, None)
    fresh[:] = stored
    assert bytes(_decoded(info, fresh, None, "k")) == TOKENS


def test_buffer_must_hold_the_raw_size():
    stored = bytes(compression.encode(memoryview(TOKENS), True, None))
    info = _info(stored, len(TOKENS), True)
    assert _landing(info, memoryview(bytearray(len(stored)))) is None  # fits the stored bytes, not the value
    assert _landing(info, memoryview(bytearray(len(TOKENS)))) is not None


def test_incompressible_stored_bytes_larger_than_the_value_land_elsewhere():
    value = bytes(range(256))
    stored = bytes(compression.encode(memoryview(value), True, None))
    assert len(stored) > len(value)
    info = _info(stored, len(value), True)
    dest = memoryview(bytearray(len(value)))
    landing = _landing(info, dest)
    assert landing.obj is not dest.obj and len(landing) == len(stored)
    landing[:] = stored
    assert bytes(_decoded(info, landing, dest, "k")) == value and bytes(dest) == value


def test_uncompressed_values_land_in_place():
    info = _info(b"hello", 5, False)
    dest = memoryview(bytearray(8))
    landing = _landing(info, dest)
    assert landing.obj is dest.obj and len(landing) == 5
    assert _decoded(info, landing, dest, "k") is landing
    assert _landing(info, memoryview(bytearray(4))) is None


# -- put options

def test_default_options_send_nothing_extra():
    choices = put_options.resolve()
    assert choices.request is None
    assert choices.write_options(False, 100) is NO_OPTIONS
    assert WRITE_OPTIONS.unpack(NO_OPTIONS.pack(100)) == (0, 0, 100, bytes(16))  # raw size = stored size; no seal


def test_options_map_to_master_and_node_encodings():
    choices = put_options.resolve(tier="ssd", pin="soft", ttl=2.5)
    assert choices.request == pb.PutOptions(tier=pb.SSD, pin=pb.PIN_SOFT, pin_ttl_seconds=600.0, ttl_seconds=2.5)
    options = choices.write_options(True, 4096)
    assert options.flags == WriteFlag.PREFER_SSD | WriteFlag.COMPRESSED
    assert (options.ttl_ms, options.soft_pin_ms, options.raw_size) == (2500, 600_000, 4096)

    hard = put_options.resolve(tier="dram", pin="hard")
    assert hard.request.tier == pb.DRAM and hard.request.pin == pb.PIN_HARD
    assert hard.write_options(False, 10)[:4] == (int(WriteFlag.HARD_PIN), 0, 0, 0)
    assert put_options.resolve(pin="soft", pin_ttl=30).write_options(False, 1).soft_pin_ms == 30_000
    assert put_options.resolve(ttl=0.0001).write_options(False, 1).ttl_ms == 1  # a tiny ttl never becomes "no expiry"


@pytest.mark.parametrize("options, message", [
    ({"tier": "nvme"}, "tier"),
    ({"tier": "DRAM"}, "tier"),
    ({"tier": 1}, "tier"),
    ({"pin": "yes"}, "pin"),
    ({"pin": ["soft"]}, "pin"),
    ({"pin_ttl": 10}, "pin_ttl applies"),
    ({"pin": "hard", "pin_ttl": 10}, "pin_ttl applies"),
    ({"pin": "soft", "pin_ttl": 0}, "pin_ttl"),
    ({"pin": "soft", "pin_ttl": float("inf")}, "pin_ttl"),
    ({"ttl": -1}, "ttl"),
    ({"ttl": 0}, "ttl"),
    ({"ttl": float("nan")}, "ttl"),
    ({"ttl": "60"}, "ttl"),
    ({"ttl": True}, "ttl"),
])
def test_bad_put_options_are_refused(options, message):
    with pytest.raises(InvalidArgumentError, match=message):
        put_options.resolve(**options)


@pytest.mark.parametrize("bad", [-0.5, float("nan"), "1", None, False])
def test_bad_hold_is_refused(bad):
    with pytest.raises(InvalidArgumentError, match="hold"):
        put_options.hold_seconds(bad)


def test_clients_refuse_bad_options_before_contacting_the_master():
    # Port 1 has no master: a typed validation error proves nothing was sent.
    with Client("127.0.0.1:1", rpc_timeout=0.5) as client:
        with pytest.raises(InvalidArgumentError, match="tier"):
            client.put("k", b"v", tier="tape")
        with pytest.raises(InvalidArgumentError, match="pin"):
            client.batch_put(["k"], [b"v"], pin="forever")
        with pytest.raises(InvalidArgumentError, match="compress"):
            client.put("k", b"v", compress="yes")
        with pytest.raises(InvalidArgumentError, match="hold"):
            client.exists("k", hold=-1)
        with pytest.raises(InvalidArgumentError, match="hold"):
            client.batch_exists(["k"], hold="soon")

    async def scenario():
        async with AsyncClient("127.0.0.1:1", rpc_timeout=0.5) as client:
            with pytest.raises(InvalidArgumentError, match="ttl"):
                await client.put("k", b"v", ttl=0)

    asyncio.run(scenario())


@pytest.mark.parametrize("api, operation", [(AsyncClient.put, writes.put), (AsyncClient.batch_put, writes.batch_put)])
def test_the_blocking_client_runs_the_put_asyncclient_hands_on_with_the_same_parameters(api, operation):
    """Client.put runs writes.put itself (AsyncClient.put only forwards to it): both must take the same
    arguments, so an option added to the API reaches the blocking Client too."""
    def parameters(function):
        return [(p.name, p.kind, p.default) for p in list(inspect.signature(function).parameters.values())[1:]]

    assert parameters(operation) == parameters(api)
    assert inspect.signature(getattr(Client, api.__name__)) == inspect.signature(api)


@pytest.mark.parametrize("option", [{"ttl": 1.8e16}, {"ttl": 100 * 365 * 86400 + 1},
                                    {"pin": "soft", "pin_ttl": 1e12}])
def test_lifetimes_past_100_years_are_refused_by_client_and_master(option):
    """A TTL or pin that no SSD header can hold: refused where the client resolves it, and by the master for a
    request that skipped the client (master/serving/messages.py), with the same message."""
    from kvpool.master.serving import messages

    with pytest.raises(InvalidArgumentError, match="100 years"):
        put_options.resolve(**option)
    request = pb.PutOptions(ttl_seconds=option.get("ttl", 0.0), pin_ttl_seconds=option.get("pin_ttl", 0.0),
                            pin=pb.PIN_SOFT if "pin" in option else pb.PIN_NONE)
    with pytest.raises(InvalidArgumentError, match="100 years"):
        messages.put_options(request)
    assert put_options.resolve(ttl=10 * 365 * 86400).write_options(False, 1).ttl_ms == 10 * 365 * 86400 * 1000  # ten years: fine
