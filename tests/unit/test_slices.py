"""The views batch_put_from and batch_get_into make of one buffer and each key's offset (aio._slices): sizes[i]
bytes at offsets[i], or, without sizes, up to the next distinct offset (or the buffer's end), in key order."""

import pytest

from kvpool.client.aio import _slices
from kvpool.errors import InvalidArgumentError

WHOLE = memoryview(bytes(range(100)))


def test_without_sizes_each_view_runs_to_the_next_offset_in_any_order():
    views = _slices(WHOLE, ["c", "a", "b", "a2"], [60, 0, 25, 0], None)
    assert [bytes(v) for v in views] == [bytes(range(60, 100)), bytes(range(25)), bytes(range(25, 60)),
                                         bytes(range(25))]


def test_with_sizes_each_view_has_its_size():
    views = _slices(WHOLE, ["a", "b", "c"], (90, 10, 10), (10, 5, 0))
    assert [bytes(v) for v in views] == [bytes(range(90, 100)), bytes(range(10, 15)), b""]


def test_many_offsets_each_get_their_own_slice():
    count = 20000
    whole = memoryview(bytearray(count * 4))
    order = list(range(count))[::-1]
    views = _slices(whole, order, [i * 4 for i in order], None)
    assert all(len(v) == 4 for v in views)
    views[0][:] = b"last"  # the last block of the buffer
    assert bytes(whole[-4:]) == b"last"


@pytest.mark.parametrize("keys, offsets, sizes", [
    (["a", "b"], [0, 90], [10, 11]),  # past the end
    (["a"], [-1], None),
    (["a", "b"], [0, 101], None),  # an offset past the end
    (["a"], [0], [1, 2]),  # more sizes than keys
    (["a", "b"], [0, 1, 2], None),  # more offsets than keys
])
def test_a_slice_outside_the_buffer_or_a_count_that_does_not_match_is_refused(keys, offsets, sizes):
    with pytest.raises(InvalidArgumentError):
        _slices(WHOLE, keys, offsets, sizes)
