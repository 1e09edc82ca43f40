"""The object tier's store against a real S3 server (SeaweedFS's gateway, kvpool/launch/s3_server.py): objects
put, read whole and by ranges, listed in pages and removed; a missing object is KeyNotFoundError; a stopped
gateway or refused credentials fail every call within its deadline as UnavailableError; a server started again
over the same directory serves what it kept."""

import dataclasses
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvpool.errors import KeyNotFoundError, UnavailableError
from kvpool.launch.s3_server import S3Server
from kvpool.objectstore.bucket import Bucket

pytestmark = pytest.mark.quick


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with S3Server(tmp_path_factory.mktemp("s3") / "data") as running:
        yield running


def names(bucket: Bucket, prefix: str = "") -> list:
    return [item for page in bucket.list(prefix) for item in page]


def test_objects_round_trip_by_whole_and_by_range_and_are_listed(server):
    bucket = Bucket(server.settings("tier-a/"))
    big = os.urandom(3 << 20)
    bucket.put("objects/big", big)
    bucket.put("objects/parts", [b"head|", memoryview(b"body|"), bytearray(b"tail")])
    assert bytes(bucket.get("objects/big")) == big
    assert bytes(bucket.get("objects/parts")) == b"head|body|tail"
    assert bucket.size("objects/big") == len(big)
    ranges = bucket.get_ranges("objects/big", [0, 1 << 20, len(big) - 10], [100, (1 << 20) + 5, len(big)])
    assert [bytes(r) for r in ranges] == [big[:100], big[1 << 20:(1 << 20) + 5], big[-10:]]
    assert names(bucket, "objects/") == [("objects/big", len(big)), ("objects/parts", 14)]
    other = Bucket(server.settings("tier-b/"))  # another prefix of the same bucket sees none of them
    assert names(other) == []
    with pytest.raises(KeyNotFoundError, match="objects/none"):
        bucket.get("objects/none")
    with pytest.raises(KeyNotFoundError):
        bucket.size("objects/none")
    bucket.delete("objects/parts")
    bucket.delete("objects/parts")  # gone already: not an error
    assert names(bucket, "objects/") == [("objects/big", len(big))]


def test_listing_goes_page_by_page_past_the_first_thousand(server):
    bucket = Bucket(server.settings("many/"))

    with ThreadPoolExecutor(16) as threads:
        list(threads.map(lambda i: bucket.put(f"k/{i:05d}", b"x"), range(1100)))
    sizes = [len(page) for page in bucket.list("k/")]
    assert sum(sizes) == 1100 and len(sizes) >= 2
    assert names(bucket, "k/")[-1] == ("k/01099", 1)


def test_refused_credentials_are_unavailable_naming_the_store(server):
    wrong = dataclasses.replace(server.settings("x/"), secret_access_key="not-the-secret")
    with pytest.raises(UnavailableError, match="failed a PUT"):
        Bucket(wrong, timeout=5).put("k", b"v")


def test_a_stopped_server_fails_calls_in_time_and_a_restarted_one_serves_what_it_kept(tmp_path):
    server = S3Server(tmp_path / "data").start()
    try:
        bucket = Bucket(server.settings("kept/"), timeout=1.5)
        bucket.put("a", b"kept across a restart")
        server.stop()
        for call in (lambda: bucket.get("a"), lambda: bucket.put("b", b"v"), lambda: names(bucket)):
            started = time.monotonic()
            with pytest.raises(UnavailableError, match="object store"):
                call()
            assert time.monotonic() - started < 4  # the call's deadline, not a hang
        again = S3Server(tmp_path / "data", access_key=server.access_key, secret_key=server.secret_key).start()
        try:
            bucket = Bucket(again.settings("kept/"))
            assert bytes(bucket.get("a")) == b"kept across a restart"
        finally:
            again.stop()
    finally:
        server.stop()
