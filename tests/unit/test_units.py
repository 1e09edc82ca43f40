import pytest

from kvpool.protocol.units import format_size, parse_size


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("64KiB", 65536), ("1GiB", 1 << 30), ("1.5MiB", 1572864), ("2GB", 2_000_000_000),
    ("64kib", 65536), (" 8 MiB ", 8 << 20), (7, 7),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "MiB", "12XB", "-1", "1..2GiB", -5])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size():
    assert format_size(512) == "512B"
    assert format_size(64 * 1024) == "64KiB"
    assert format_size(3 << 29) == "1.5GiB"
