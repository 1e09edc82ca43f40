"""The read path's lookups when a node no longer holds the version the master named (client/reads.py): an
overwrite that ended between the lookup and the read is read at its new version, never reported missing; an
evicted version (the master names it again) is missing after one more lookup; the lookups are bounded."""

import asyncio
from types import SimpleNamespace

from kvpool.proto import kvpool_pb2 as pb

from kvpool.client import reads
from kvpool.client.waiting import LOOP_IO
from kvpool.client.placement_cache import PlacementCache
from kvpool.errors import KeyNotFoundError

CHECKSUM = 7
VALUE = b"v" * 16


class Master:
    """Answers each lookup with the next generation of `generations` (the last one again when they run out)."""

    def __init__(self, generations: list):
        self.generations = generations
        self.asked = 0

    async def call(self, method: str, request):
        generation = self.generations[min(self.asked, len(self.generations) - 1)]
        self.asked += 1
        return pb.GetReplicaListResponse(object=pb.ObjectInfo(
            key=request.key, size=len(VALUE), checksum=CHECKSUM, generation=generation,
            replicas=[pb.Replica(address="10.0.0.1:1"), pb.Replica(address="10.0.0.2:1")]))


class Nodes:
    """Both nodes hold only the generations in `held`."""

    def __init__(self, held: set):
        self.held = held

    async def read_into(self, address: str, key: bytes, generation: int, buf) -> int:
        if generation not in self.held:
            raise KeyNotFoundError(f"no generation {generation} of this key here")
        buf[:] = VALUE
        return CHECKSUM


def _get(master: Master, nodes: Nodes):
    core = SimpleNamespace(cache=PlacementCache(), shared=None, stored_keys=lambda keys: keys, master=master, io=LOOP_IO,
                           transport=nodes, read_deadline=lambda nbytes: 5.0)
    return asyncio.run(reads.read(core, ["k"], None))[0]


def test_a_version_freed_by_an_overwrite_after_the_lookup_is_read_at_the_new_version():
    master = Master([1, 2])
    assert bytes(_get(master, Nodes({2}))) == VALUE
    assert master.asked == 2


def test_a_key_overwritten_again_and_again_is_looked_up_while_each_answer_is_newer():
    master = Master([1, 2, 3])
    assert bytes(_get(master, Nodes({3}))) == VALUE
    assert master.asked == 3


def test_a_version_the_master_names_again_is_evicted_and_missing():
    master = Master([1, 1])
    assert isinstance(_get(master, Nodes(set())), KeyNotFoundError)
    assert master.asked == 2


def test_lookups_of_one_key_are_bounded():
    master = Master(list(range(1, 100)))
    assert isinstance(_get(master, Nodes(set())), KeyNotFoundError)
    assert master.asked == 1 + reads.MAX_LOOKUPS
