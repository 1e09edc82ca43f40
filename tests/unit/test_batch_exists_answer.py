"""A BatchExists without a hold is answered at once (MasterService.serve_now, no coroutine): the same
answers as ever, every bad key refused with its index, a hold still waited for."""

import asyncio
import types

import pytest

from kvpool.master.serving.metrics import MasterMetrics
from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.objects import ObjectTable
from kvpool.master.serving.service import MasterService
from kvpool.proto import kvpool_pb2 as pb
from kvpool.security.roles import CLIENT

from test_objects import put, record


@pytest.fixture
def service():
    table = ObjectTable(first_generation=100)
    table.upsert_node(record("n1"))
    put(table, "here")
    return MasterService(table, NodeIO(), MasterMetrics(table), "m", "127.0.0.1:1")


def test_answered_without_waiting(service):
    answer = service.serve_now("BatchExists", pb.BatchExistsRequest(keys=["here", "gone", "here"]), CLIENT)
    assert answer.status == pb.OK and list(answer.exists) == [True, False, True]


@pytest.mark.parametrize("bad, why", [
    ("", "must not be empty"),
    ("a" * 1025, "at most 1024"),
    ("é" * 600, "at most 1024"),  # 600 characters, 1200 bytes
    ("a\x00b", "NUL"),
])
def test_each_bad_key_is_refused_with_its_index(service, bad, why):
    answer = service.serve_now("BatchExists", pb.BatchExistsRequest(keys=["here", bad]), CLIENT)
    assert answer.status == pb.INVALID_KEY and answer.message.startswith("keys[1]: ") and why in answer.message


def test_long_and_non_ascii_keys_that_are_valid_are_looked_up(service):
    keys = ["a" * 1024, "é" * 512, "here"]
    answer = service.serve_now("BatchExists", pb.BatchExistsRequest(keys=keys), CLIENT)
    assert answer.status == pb.OK and list(answer.exists) == [False, False, True]


def test_a_hold_is_waited_for(service):
    pending = service.serve_now("BatchExists", pb.BatchExistsRequest(keys=["gone"], hold_seconds=1.0), CLIENT)
    assert isinstance(pending, types.CoroutineType)
    answer = asyncio.run(pending)
    assert answer.status == pb.OK and list(answer.exists) == [False]
    bad = service.serve_now("BatchExists", pb.BatchExistsRequest(keys=["here"], hold_seconds=-1), CLIENT)
    assert bad.status == pb.INVALID_ARGUMENT


def test_counted_once_each(service):
    for _ in range(3):
        service.serve_now("BatchExists", pb.BatchExistsRequest(keys=["here"]), CLIENT)
    assert service._metrics.registry.get_sample_value("kvpool_master_rpcs_total", {"method": "BatchExists"}) == 3
