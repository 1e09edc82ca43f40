"""A node's etcd record (kvpool/protocol/cluster_layout.py NodeRecord): its JSON form is fixed (golden), and a
record from a newer release, with fields this one does not know, is still taken (a rolling upgrade has nodes of
the new release registering with masters of the old one)."""

import json

import pytest

from kvpool.protocol.cluster_layout import NodeRecord, TierRecord

GOLDEN = (b'{"node_id": "node-1", "instance": "i1", "host": "10.0.0.5", "data_port": 7000, "transports": ["shm", '
          b'"tcp"], "transport_info": {"shm": {"size": 1024}}, "tiers": {"dram": {"capacity": 1024, "path": '
          b'"/dev/shm/x"}}, "metrics_port": 9100, "pid": 42, "zone": "rack-a"}')


def record() -> NodeRecord:
    return NodeRecord("node-1", "i1", "10.0.0.5", 7000, ["shm", "tcp"], {"shm": {"size": 1024}},
                      {"dram": TierRecord(1024, "/dev/shm/x")}, 9100, 42, "rack-a")


def test_the_json_form_is_fixed_and_reads_back():
    assert record().to_json() == GOLDEN
    assert NodeRecord.from_json(GOLDEN) == record()


def test_fields_of_a_newer_release_are_left_out_not_refused():
    newer = json.loads(GOLDEN)
    newer["stopping"] = True
    newer["tiers"]["dram"]["media"] = "hbm"
    assert NodeRecord.from_json(json.dumps(newer).encode()) == record()


@pytest.mark.parametrize("raw", [b"[]", b'"x"', b'{"node_id": "n"}', b'{"tiers": {"dram": 5}, "node_id": "n"}'])
def test_a_malformed_record_is_still_refused(raw):
    with pytest.raises((ValueError, TypeError, KeyError)):
        NodeRecord.from_json(raw)
