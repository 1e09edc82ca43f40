"""The blocking Client's lookups are answered on its control connection in the caller's thread: no event
loop runs for them, they still see the client's own puts (whose ends were posted) and refuse bad keys."""

import sys

import pytest

from kvpool import Client
from kvpool.errors import InvalidKeyError

_LOOP_ENTRIES = ("run_until_complete", "run_forever")


class LoopWatch:
    """Counts how often any event loop is entered in this thread while active."""

    def __init__(self):
        self.entered = 0

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_name in _LOOP_ENTRIES and "asyncio" in frame.f_code.co_filename:
            self.entered += 1

    def __enter__(self):
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)


def test_lookups_run_no_event_loop_and_see_the_clients_own_puts(cluster):
    with Client(cluster.master_address) as client:
        client.put("lookups/warm", b"w" * 100)  # the leader and its control port are known from here on
        keys = [f"lookups/{i}" for i in range(32)]
        with LoopWatch() as watch:
            assert client.batch_exists(keys) == [False] * 32
            assert client.exists("lookups/warm") and not client.exists("lookups/never")
            assert client.batch_exists([]) == []
        assert watch.entered == 0
        for i, key in enumerate(keys[:8]):
            client.put(key, bytes([i]) * 1000)  # its PutEnd is posted: the lookup right after must see it
            with LoopWatch() as watch:
                assert client.batch_exists(keys) == [k in keys[:i + 1] for k in keys]
                assert client.exists(key)
            assert watch.entered == 0
        with LoopWatch() as watch:  # a get over shared memory still runs the loop: the watch sees it
            assert client.get(keys[0]) == bytes([0]) * 1000
        assert watch.entered > 0
        client.remove_prefix("lookups/")


@pytest.mark.parametrize("bad", ["", 7, "nul\x00key", "k" * 1025, "é" * 513])
def test_a_bad_key_in_a_lookup_is_refused_by_the_client(cluster, bad):
    with Client(cluster.master_address) as client:
        with pytest.raises(InvalidKeyError):
            client.batch_exists(["lookups/fine", bad])
        with pytest.raises(InvalidKeyError):
            client.exists(bad)
        assert client.batch_exists(["lookups/fine", "é" * 10]) == [False, False]  # non-ASCII keys are fine
