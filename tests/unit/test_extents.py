import random

import pytest

from kvpool.storenode.extents import ExtentRecord, ExtentTable


def test_record_lookup_and_counts():
    t = ExtentTable()
    t.record(0, b"a", 1, 100, 11)
    t.record(100, b"b", 2, 50, 22)
    assert t.lookup(0, b"a", 1, 100) == ExtentRecord(b"a", 1, 100, 11)
    assert t.lookup(100, b"b", 2, 50).checksum == 22
    assert (t.objects, t.bytes) == (2, 150)


@pytest.mark.parametrize("offset,key,gen,length", [
    (0, b"a", 2, 100),    # other generation
    (0, b"b", 1, 100),    # other key
    (0, b"a", 1, 99),     # other length
    (1, b"a", 1, 100),    # not the start of the extent
    (500, b"a", 1, 100),  # nothing there
])
def test_lookup_mismatch_is_none(offset, key, gen, length):
    t = ExtentTable()
    t.record(0, b"a", 1, 100, 0)
    assert t.lookup(offset, key, gen, length) is None


def test_free_needs_key_and_generation():
    t = ExtentTable()
    t.record(10, b"k", 5, 20, 0)
    assert not t.free(10, b"k", 4)
    assert not t.free(10, b"x", 5)
    assert not t.free(11, b"k", 5)
    assert t.free(10, b"k", 5)
    assert not t.free(10, b"k", 5)
    assert (t.objects, t.bytes) == (0, 0)
    assert t.lookup(10, b"k", 5, 20) is None


def test_overlapping_write_drops_stale_records():
    t = ExtentTable()
    for i in range(5):
        t.record(i * 100, b"old%d" % i, i, 100, 0)
    # [150, 350) overlaps the records at 100, 200 and 300 but not 0 or 400
    t.record(150, b"new", 9, 200, 0)
    assert t.lookup(0, b"old0", 0, 100)
    assert t.lookup(400, b"old4", 4, 100)
    for i in (1, 2, 3):
        assert t.lookup(i * 100, b"old%d" % i, i, 100) is None
    assert t.lookup(150, b"new", 9, 200)
    assert (t.objects, t.bytes) == (3, 400)


def test_adjacent_extents_do_not_overlap():
    t = ExtentTable()
    t.record(0, b"a", 1, 100, 0)
    t.record(200, b"c", 1, 100, 0)
    t.record(100, b"b", 1, 100, 0)
    assert all(t.lookup(o, k, 1, 100) for o, k in ((0, b"a"), (100, b"b"), (200, b"c")))
    assert t.invalidate(100, 0) == 0


def test_rewrite_same_offset_replaces():
    t = ExtentTable()
    t.record(0, b"a", 1, 100, 0)
    t.record(0, b"a", 2, 40, 0)
    assert t.lookup(0, b"a", 1, 100) is None
    assert t.lookup(0, b"a", 2, 40)
    assert (t.objects, t.bytes) == (1, 40)


def test_rejects_empty_or_negative_extent():
    t = ExtentTable()
    with pytest.raises(ValueError):
        t.record(0, b"a", 1, 0, 0)
    with pytest.raises(ValueError):
        t.record(-1, b"a", 1, 10, 0)


def test_matches_a_byte_map_model():
    """Random writes against a per-byte owner map: surviving records are exactly the untouched ones."""
    rng = random.Random(7)
    size = 1000
    t = ExtentTable()
    owner = [None] * size  # which write last covered each byte
    extents = {}
    for gen in range(400):
        offset = rng.randrange(size - 1)
        length = rng.randint(1, min(120, size - offset))
        t.record(offset, b"k", gen, length, 0)
        extents[gen] = (offset, length)
        owner[offset:offset + length] = [gen] * length
        if rng.random() < 0.2:  # free a random surviving extent
            live = [g for g, (o, n) in extents.items() if t.lookup(o, b"k", g, n)]
            g = rng.choice(live)
            assert t.free(extents[g][0], b"k", g)
            o, n = extents.pop(g)
            owner[o:o + n] = [None] * n
    alive = {g for g, (o, n) in extents.items() if t.lookup(o, b"k", g, n)}
    untouched = {g for g, (o, n) in extents.items() if owner[o:o + n] == [g] * n}
    assert alive == untouched
    assert t.objects == len(alive)
    assert t.bytes == sum(extents[g][1] for g in alive)
