"""A call's deadline (client/deadlines.py) and how a put's end is settled (client/commits.py), without a cluster."""

import asyncio
import inspect
import time

import pytest

from kvpool import AsyncClient, Client
from kvpool.client.commits import Commits, settle
from kvpool.client.deadlines import CallDeadline
from kvpool.client.waiting import LOOP_IO
from kvpool.connectors.client_settings import CONNECTOR_TIMEOUT, client_settings
from kvpool.errors import (
    BatchError, DeadlineExceededError, InvalidArgumentError, KeyExistsError, KeyNotFoundError, PutExpiredError,
    PutOutcomeUnknownError, UnavailableError,
)
from kvpool.proto import kvpool_pb2 as pb

PUBLIC_CALLS = ("put", "batch_put", "get", "get_into", "batch_get", "batch_get_into", "put_from", "batch_put_from",
                "put_parts", "get_into_parts", "batch_put_parts", "batch_get_into_parts", "exists", "batch_exists",
                "remove", "remove_prefix", "stats", "drain", "flush")


@pytest.mark.parametrize("name", PUBLIC_CALLS)
def test_every_public_call_takes_a_timeout_on_both_clients(name):
    for api in (AsyncClient, Client):
        parameters = inspect.signature(getattr(api, name)).parameters
        assert "timeout" in parameters or "options" in parameters, f"{api.__name__}.{name}"
    assert inspect.signature(getattr(Client, name)) == inspect.signature(getattr(AsyncClient, name))
    assert inspect.signature(AsyncClient.__init__).parameters["timeout"].default <= 5


def test_a_call_past_its_deadline_raises_the_typed_error_on_the_loop():
    async def scenario():
        started = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="sleeping did not finish within its 0.05s deadline"):
            async with CallDeadline(LOOP_IO, 0.05, "sleeping"):
                await asyncio.sleep(10)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 1.0


def test_which_failures_past_the_deadline_are_the_deadlines():
    passed = CallDeadline(None, 0.001, "get of 'k'")
    time.sleep(0.01)
    assert isinstance(passed.overdue(UnavailableError("node silent")), DeadlineExceededError)
    assert isinstance(passed.overdue(TimeoutError()), DeadlineExceededError)
    assert passed.overdue(KeyNotFoundError("k")) is None  # an answer, not the want of one
    assert passed.overdue(BatchError("", {"k": KeyExistsError("k")})) is None
    assert isinstance(passed.overdue(BatchError("", {"k": UnavailableError("x")})), DeadlineExceededError)
    passed.ending = True  # a put whose end left: it may have been stored
    assert isinstance(passed.overdue(UnavailableError("no answer")), PutOutcomeUnknownError)
    in_time = CallDeadline(None, 60, "get of 'k'")
    assert in_time.overdue(UnavailableError("node gone")) is None  # failed by itself, not by the deadline


class _Master:
    """Answers lookups from a table key -> generation (missing: not found), or fails them all."""

    def __init__(self, table: dict, fails: Exception | None = None):
        self.table, self.fails = table, fails

    async def call(self, method, request):
        if self.fails is not None:
            raise self.fails
        keys = [request.key] if method == "GetReplicaList" else list(request.keys)
        items = [pb.GetReplicaListResponse(object=pb.ObjectInfo(key=key, generation=self.table[key]))
                 if key in self.table else pb.GetReplicaListResponse(status=pb.NOT_FOUND) for key in keys]
        return items[0] if method == "GetReplicaList" else pb.BatchGetReplicaListResponse(items=items)


def test_a_doubtful_end_is_settled_by_where_the_master_says_the_key_is():
    keys = ["stored", "revoked", "overwritten", "refused", "exists"]
    errors = {0: PutExpiredError("no pending put"), 1: UnavailableError("answer lost"),
              2: PutExpiredError("no pending put"), 4: KeyExistsError("exists")}
    master = _Master({"stored": 7, "revoked": 3, "overwritten": 9})
    settled = asyncio.run(settle(master, keys, [7, 7, 7, 7, 7], errors))
    assert 0 not in settled  # the master holds it at the put's generation: the put took
    assert isinstance(settled[1], PutExpiredError) and "not stored" in str(settled[1])  # an older one: not stored
    assert isinstance(settled[2], PutOutcomeUnknownError) and "newer generation 9" in str(settled[2])
    assert isinstance(settled[4], KeyExistsError)  # a plain refusal is not doubted
    assert 3 not in settled
    unreachable = asyncio.run(settle(_Master({}, UnavailableError("no master")), keys, [7] * 5, errors))
    assert all(isinstance(unreachable[i], PutOutcomeUnknownError) for i in (0, 1, 2))
    assert isinstance(unreachable[4], KeyExistsError)


def test_connectors_bound_every_call_below_the_cost_of_recomputing():
    assert client_settings({"master": "h:1"}, "in test")["timeout"] == CONNECTOR_TIMEOUT < 5
    assert client_settings({"master": "h:1", "timeout": "0.5"}, "in test")["timeout"] == 0.5
    for bad in ("soon", 0, -1):
        with pytest.raises(InvalidArgumentError, match="timeout.*in test"):
            client_settings({"master": "h:1", "timeout": bad}, "in test")


def test_a_nodes_share_of_a_call_leaves_it_time_for_another_replica():
    """Unless given, read and write timeouts are 3 s, or 0.6 of the call's timeout when that is less: a
    connector's 2 s call waits 1.2 s for a silent replica and still has time for the next one."""
    shares = {}
    for timeout in (5.0, 2.0, CONNECTOR_TIMEOUT, 30.0):
        client = AsyncClient("127.0.0.1:1", timeout=timeout)
        shares[timeout] = (client._core.read_timeout, client._core.write_timeout)
    assert shares[5.0] == (3.0, 3.0) and shares[30.0] == (3.0, 3.0)
    assert shares[2.0] == pytest.approx((1.2, 1.2))
    assert max(shares[CONNECTOR_TIMEOUT]) < CONNECTOR_TIMEOUT
    given = AsyncClient("127.0.0.1:1", timeout=2.0, read_timeout=1.9, write_timeout=0.3)._core
    assert (given.read_timeout, given.write_timeout) == (1.9, 0.3)


class _Leader(_Master):
    """What Commits needs of a master link: posted ends, calls, and an io to retry on."""

    io = LOOP_IO

    def __init__(self, table: dict, end_answer, hang: bool = False):
        super().__init__(table)
        self.end_answer, self.hang, self.posted = end_answer, hang, []

    def post(self, method, request, callback) -> bool:
        self.posted.append(callback)
        return True

    async def drain(self, timeout=None) -> None:
        pass

    async def call(self, method, request):
        if method == "PutEnd":
            if self.hang:
                await asyncio.sleep(60)
            return self.end_answer
        return await super().call(method, request)


@pytest.mark.parametrize("table, hang, reported", [
    ({"k": 7}, False, None),  # the lost answer had ended it: flush reports nothing
    ({}, False, PutExpiredError),  # not there: not stored
    ({"k": 7}, True, PutOutcomeUnknownError),  # nothing learnt before flush's deadline
])
def test_flush_reports_what_happened_to_a_put_whose_answer_was_lost(table, hang, reported):
    async def scenario():
        master = _Leader(table, pb.StatusResponse(status=pb.PUT_EXPIRED, message="no pending put"), hang)
        forgotten = []
        commits = Commits(master, forgotten.append)
        await commits.end("PutEnd", pb.PutEndRequest(key="k", generation=7), ["k"], [7], overwrite=False)
        [answered] = master.posted
        answered(UnavailableError("connection lost"))  # the answer went with the connection
        try:
            await commits.flush(0.2)
        except BatchError as exc:
            return exc.errors, forgotten
        return {}, forgotten

    errors, forgotten = asyncio.run(scenario())
    if reported is None:
        assert errors == {} and forgotten == []
    else:
        assert isinstance(errors["k"], reported) and forgotten == ["k"]
