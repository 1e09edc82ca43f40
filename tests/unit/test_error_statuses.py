"""The non-OK statuses a master's answer carries, as its metrics count them (messages.error_statuses): an
answer's own status, each item's, and a BatchPutStart's refused puts (its columns, no items)."""

from kvpool.master.serving.messages import error_statuses
from kvpool.proto import kvpool_pb2 as pb


def test_a_batch_put_starts_refused_puts_are_its_error_statuses():
    started = pb.BatchPutStartResponse(generations=[0, 5, 0], placement=[0, 0, 0], refused=[0, 2], errors=[
        pb.StatusResponse(status=pb.TOO_LARGE, message="too large"), pb.StatusResponse(status=pb.INVALID_KEY)])
    assert error_statuses(started) == ["TOO_LARGE", "INVALID_KEY"]
    assert error_statuses(pb.BatchPutStartResponse(generations=[5], placement=[0])) == []


def test_items_and_a_status_are_counted_too():
    ended = pb.BatchStatusResponse(items=[pb.StatusResponse(), pb.StatusResponse(status=pb.PUT_EXPIRED)])
    assert error_statuses(ended) == ["PUT_EXPIRED"]
    assert error_statuses(pb.BatchStatusResponse(items=[pb.StatusResponse()] * 3)) == []
    assert error_statuses(pb.PutStartResponse(status=pb.NO_SPACE)) == ["NO_SPACE"]
    assert error_statuses(pb.PutStartResponse(status=pb.OK)) == []
