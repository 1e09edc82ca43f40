"""The cross-component contracts: status codes, generated protobuf code, frame layout, keys."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvpool import errors
from kvpool.protocol import wire
from kvpool.protocol.keys import MAX_KEY_BYTES, validate_key
from kvpool.proto import kvpool_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_status_codes_match_proto():
    for status in kvpool_pb2.Status.DESCRIPTOR.values:
        assert errors.Code[status.name] == status.number


def test_error_for_keeps_the_type():
    err = errors.error_for(errors.Code.NOT_FOUND, "no such key")
    assert isinstance(err, errors.KeyNotFoundError) and isinstance(err, KeyError)
    assert str(err) == "no such key"
    assert isinstance(errors.error_for(250, ""), errors.InternalError)


def test_generated_code_matches_proto():
    result = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_request_frame_layout():
    frame = wire.pack_request(wire.Op.READ, 7, b"key", generation=5, arg=64, length=10, checksum=99)
    assert len(frame) == wire.REQUEST.size + 3
    magic, version, op, req_id, key_len, _flags, gen, off, length, csum = wire.REQUEST.unpack_from(frame)
    assert (magic, version, op, req_id, key_len, gen, off, length, csum) == (b"KV", 3, 2, 7, 3, 5, 64, 10, 99)
    with pytest.raises(ValueError):
        wire.pack_request(wire.Op.READ, 1, b"k" * (MAX_KEY_BYTES + 1))


def test_sealed_write_golden_bytes():
    """The leader's seal and a WRITE carrying it outlive a version: a change here breaks mixed clusters."""
    from kvpool.protocol.write_options import WriteOptions
    from kvpool.security.placement_seal import for_secret

    sealer = for_secret("0" * 64)
    fields = (b"model/blk-1", 1234567890123, 4096, 0xDEADBEEF, 7, 2, 1500, 0, 4096)
    seal = sealer.seal(b"node-a", *fields)
    assert seal.hex() == "3c49498cf1445f4412a030cd29b4c306"
    assert sealer.valid(seal, b"node-a", *fields)
    assert not sealer.valid(seal, b"node-b", *fields)  # another node's copy
    assert not sealer.valid(seal, b"node-a", b"model/blk-1", 1234567890124, *fields[2:])  # another generation
    assert not sealer.valid(bytes(16), b"node-a", *fields)
    assert not for_secret("1" * 64).valid(seal, b"node-a", *fields)  # another cluster's
    frame = wire.pack_with_options(wire.Op.WRITE, 9, b"model/blk-1", 1234567890123, 7, 4096, 0xDEADBEEF,
                                   WriteOptions(2, 1500, 0, 0, seal))
    assert frame.hex() == ("4b560301090000000b000200cb04fb711f01000007000000000000000010000000000000efbeadde00000000"
                           "6d6f64656c2f626c6b2d31dc050000000000000000000000000000001000000000000"
                           "03c49498cf1445f4412a030cd29b4c306")


@pytest.mark.parametrize("key", ["", "x" * (MAX_KEY_BYTES + 1), "a\x00b", b"bytes", "\ud800"])
def test_invalid_keys(key):
    with pytest.raises(errors.InvalidKeyError):
        validate_key(key)


def test_valid_key_bytes():
    assert validate_key("model/blk-é") == "model/blk-é".encode()


def test_digest_in_pieces_equals_checksum_of_whole():
    import os

    from kvpool.protocol.checksum import Digest, checksum

    data = os.urandom(1_000_003)
    digest = Digest(data[:10])
    for start in range(10, len(data), 65_536):
        digest.update(data[start:start + 65_536])
    assert digest.intdigest() == checksum(data)
