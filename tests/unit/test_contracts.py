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
    assert (magic, version, op, req_id, key_len, gen, off, length, csum) == (b"KV", 2, 2, 7, 3, 5, 64, 10, 99)
    with pytest.raises(ValueError):
        wire.pack_request(wire.Op.READ, 1, b"k" * (MAX_KEY_BYTES + 1))


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
