"""The client's control-port frames without I/O (kvpool/protocol/control.py): golden bytes of a call and of
replies, replies matched by req_id however they arrive, and what each reply means."""

import pytest

from kvpool.protocol.control import ControlCalls, LeaderHint, NotSent
from kvpool.errors import InvalidKeyError, KeyNotFoundError, ProtocolError, UnavailableError
from kvpool.proto import kvpool_pb2 as pb

# "KV", version 3, op 41 (BATCH_EXISTS), req_id 1, no key, flags 0, generation 0, arg 0, body length 16,
# checksum 0; then BatchExistsRequest(keys=["a", "bc"], hold_seconds=2.5).
CALL = bytes.fromhex("4b5603290100000000000000000000000000000000000000000000001000000000000000000000000000"
                     "00000a01610a026263110000000000000440")
# A reply: "KV", version 3, op 41, req_id 1, status OK, flags 0, length 4, checksum 0; BatchExistsResponse
# (exists=[True, False]).
REPLY_1 = bytes.fromhex("4b5603290100000000000000040000000000000000000000000000001a020100")
# A NOT_LEADER reply to req_id 7 naming the leader and its control port.
NOT_LEADER_7 = bytes.fromhex("4b560328070000000c0000002b0000000000000000000000000000007b226c6561646572223a2022683a"
                             "31222c2022636f6e74726f6c5f61646472657373223a2022683a32227d")


def reply(req_id: int, status: int, body: bytes, op: int = 41) -> bytes:
    """A reply frame like REPLY_1, for another req_id, status or body."""
    header = bytearray(REPLY_1[:28])
    header[3] = op
    header[4:8] = req_id.to_bytes(4, "little")
    header[8] = status
    header[12:20] = len(body).to_bytes(8, "little")
    return bytes(header) + body


def test_a_call_is_packed_to_the_golden_bytes_and_req_ids_count_up():
    calls = ControlCalls("m:1")
    req_id, frame = calls.start("BatchExists", pb.BatchExistsRequest(keys=["a", "bc"], hold_seconds=2.5), "w1")
    assert (req_id, frame) == (1, CALL)
    second, frame = calls.start("BatchExists", pb.BatchExistsRequest(keys=["a", "bc"], hold_seconds=2.5), "w2")
    assert second == 2 and frame[4:8] == (2).to_bytes(4, "little") and frame[8:] == CALL[8:]
    assert calls.waiting == {1: ("BatchExists", "w1"), 2: ("BatchExists", "w2")}


def test_a_reply_cut_anywhere_settles_its_call_once_whole():
    calls = ControlCalls("m:1")
    calls.start("BatchExists", pb.BatchExistsRequest(keys=["a", "bc"]), "waiter")
    settled = []
    for i in range(len(REPLY_1)):
        settled += calls.received(REPLY_1[i:i + 1])
        assert settled == [] or i == len(REPLY_1) - 1
    [(waiter, response)] = settled
    assert waiter == "waiter" and list(response.exists) == [True, False]
    assert calls.waiting == {}


def test_replies_that_overtake_each_other_reach_their_own_calls():
    calls = ControlCalls("m:1")
    for name in ("first", "second", "third"):
        calls.start("BatchExists", pb.BatchExistsRequest(keys=["k"]), name)
    body_of = {n: pb.BatchExistsResponse(exists=[n == 2]).SerializeToString() for n in (1, 2, 3)}
    data = reply(3, 0, body_of[3]) + reply(1, 0, body_of[1]) + reply(2, 0, body_of[2])[:30]
    settled = calls.received(data)
    assert [(w, list(r.exists)) for w, r in settled] == [("third", [False]), ("first", [False])]
    [(waiter, response)] = calls.received(reply(2, 0, body_of[2])[30:])
    assert waiter == "second" and list(response.exists) == [True]


def test_a_reply_for_a_call_given_up_is_skipped():
    calls = ControlCalls("m:1")
    req_id, _ = calls.start("BatchExists", pb.BatchExistsRequest(keys=["k"]), "gone")
    calls.start("BatchExists", pb.BatchExistsRequest(keys=["k"]), "kept")
    assert calls.forget(req_id) == ("BatchExists", "gone")
    settled = calls.received(REPLY_1 + reply(2, 0, b""))
    assert [waiter for waiter, _ in settled] == ["kept"]


def test_what_a_status_stands_for():
    calls = ControlCalls("m:1")
    for _ in range(7):
        calls.start("Exists", pb.ExistsRequest(key="k"), "w")
    [(_, hint)] = calls.received(NOT_LEADER_7)
    assert isinstance(hint, LeaderHint) and (hint.leader, hint.control_address) == ("h:1", "h:2")
    [(_, missing), (_, invalid), (_, garbled)] = calls.received(
        reply(1, 1, b"no such key", op=40) + reply(2, 5, b"empty key", op=40) + reply(3, 0, b"\xff\xff", op=40))
    assert isinstance(missing, KeyNotFoundError) and "m:1 Exists: no such key" in str(missing)
    assert isinstance(invalid, InvalidKeyError) and "empty key" in str(invalid)
    assert isinstance(garbled, ProtocolError) and "bad answer" in str(garbled)


def test_a_frame_of_another_protocol_is_refused():
    calls = ControlCalls("m:1")
    calls.start("BatchExists", pb.BatchExistsRequest(keys=["k"]), "w")
    with pytest.raises(ProtocolError, match="bad reply frame"):
        calls.received(b"HTTP/1.1 200 OK\r\n\r\nhello, world")


def test_a_connection_that_ended_fails_its_calls_and_sends_no_more():
    calls = ControlCalls("m:1")
    calls.start("BatchExists", pb.BatchExistsRequest(keys=["k"]), "a")
    calls.start("Exists", pb.ExistsRequest(key="k"), "b")
    ended = calls.end("connection lost")
    assert sorted(waiter for waiter, _ in ended) == ["a", "b"]
    assert all(isinstance(error, UnavailableError) and "connection lost" in str(error) for _, error in ended)
    assert calls.closed and calls.waiting == {}
    with pytest.raises(NotSent):
        calls.start("Exists", pb.ExistsRequest(key="k"), "c")


# A posted call: "KV", version 3, op 36 (BATCH_PUT_END), req_id 1, no key, flags 1 (POSTED), generation 0,
# arg 0, body length 6, checksum 0; then BatchPutEndRequest(keys=["a"], generations=[7]).
POSTED_CALL = bytes.fromhex("4b560324010000000000010000000000000000000000000000000000060000000000000000000000"
                            "000000001201611a0107")


def test_a_posted_call_carries_the_posted_flag_in_the_golden_bytes():
    from kvpool.protocol import control
    calls = ControlCalls("m:1")
    _, frame = calls.start("BatchPutEnd", pb.BatchPutEndRequest(keys=["a"], generations=[7]), "w", control.POSTED)
    assert frame == POSTED_CALL
    _, plain = calls.start("BatchPutEnd", pb.BatchPutEndRequest(keys=["a"], generations=[7]), "w")
    assert plain[10] == 0 and POSTED_CALL[10] == control.POSTED == 1


# A lookup in its lean frame: "KV", version 3, op 46 (LOOKUP), req_id 1, no key, flags 0, generation 0, arg 0,
# body length 4, checksum 0; then the keys "a" and "bc" in UTF-8 joined by NUL. Op 41 (BATCH_EXISTS) is unchanged.
LOOKUP_CALL = bytes.fromhex("4b56032e0100000000000000000000000000000000000000000000000400000000000000000000000000"
                            "000061006263")
# Its answer: "KV", version 3, op 46, req_id 1, status OK, flags 0, length 2, checksum 0; a byte per key.
LOOKUP_REPLY = bytes.fromhex("4b56032e0100000000000000020000000000000000000000000000000100")


def test_a_lookup_is_packed_to_the_golden_bytes_and_its_answer_read_as_a_bool_per_key():
    from kvpool.protocol import control
    calls = ControlCalls("m:1")
    req_id, frame = calls.start(control.LOOKUP, control.pack_keys(["a", "bc"]), "w")
    assert (req_id, frame) == (1, LOOKUP_CALL)
    [(waiter, found)] = calls.received(LOOKUP_REPLY)
    assert waiter == "w" and found == [True, False]
    assert control.parse_keys(LOOKUP_CALL[44:]) == ["a", "bc"] and control.parse_keys(b"") == []
    assert control.parse_keys(control.pack_keys(["é", "x"])) == ["é", "x"]
    assert control.found_body([True, False]) == LOOKUP_REPLY[28:]


def test_a_lookup_answer_that_is_not_bytes_of_0_and_1_fails_its_call_only():
    from kvpool.protocol import control
    calls = ControlCalls("m:1")
    calls.start(control.LOOKUP, control.pack_keys(["a", "bc"]), "garbled")
    calls.start(control.LOOKUP, control.pack_keys(["a"]), "fine")
    [(_, garbled), (_, fine)] = calls.received(reply(1, 0, b"\x01\x02", op=46) + reply(2, 0, b"\x00", op=46))
    assert isinstance(garbled, ProtocolError) and "bad answer" in str(garbled)
    assert fine == [False]
