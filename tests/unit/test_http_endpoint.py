"""The metrics and probes HTTP server (kvpool/runtime/http_endpoint.py) on a real socket in this process: the
answers, bad requests, and its bounds (a deadline from accept, a cap that displaces the oldest); and how the
servers fit their connection caps under the descriptor limit (kvpool/runtime/process.py)."""

import asyncio

import pytest

from prometheus_client import CollectorRegistry, Counter

from kvpool.runtime.http_endpoint import HttpEndpoint
from kvpool.runtime.process import fit_caps


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("kvpool_test_things", "Things counted", registry=registry).inc(3)
    return registry


async def _ask(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


def _serving(test, **options):
    async def run():
        endpoint = HttpEndpoint(_registry(), lambda path: (503, b"not yet\n") if path == "/readyz" else (200, b"ok\n"),
                                **options)
        port = await endpoint.start("127.0.0.1", 0)
        try:
            await test(endpoint, port)
        finally:
            endpoint.close()
    asyncio.run(run())


def test_metrics_probes_and_bad_requests_are_answered():
    async def test(_endpoint, port):
        metrics = await _ask(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert metrics.startswith(b"HTTP/1.1 200 OK\r\n") and b"kvpool_test_things_total 3.0" in metrics
        assert b"Content-Type: text/plain" in metrics
        openmetrics = await _ask(port, b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text\r\n\r\n")
        assert b"application/openmetrics-text" in openmetrics and openmetrics.endswith(b"# EOF\n")
        assert (await _ask(port, b"GET /healthz HTTP/1.1\r\n\r\n")).endswith(b"\r\n\r\nok\n")
        assert (await _ask(port, b"GET /readyz?x=1 HTTP/1.0\r\n\r\n")).startswith(b"HTTP/1.1 503 ")
        head = await _ask(port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 OK") and head.endswith(b"\r\n\r\n")
        assert (await _ask(port, b"POST /metrics HTTP/1.1\r\n\r\n")).startswith(b"HTTP/1.1 405 ")
        assert (await _ask(port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        assert await _ask(port, b"GET /" + b"x" * 10_000 + b" HTTP/1.1\r\n\r\n") == b""  # head too large: closed
    _serving(test)


def test_a_silent_connection_is_closed_at_the_deadline_and_the_oldest_displaced_past_the_cap():
    async def test(endpoint, port):
        loop = asyncio.get_running_loop()
        started = loop.time()
        silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
        # A fifth connection past the cap of 4 displaces the oldest silent one; it is served at once.
        assert (await _ask(port, b"GET /healthz HTTP/1.1\r\n\r\n")).endswith(b"ok\n")
        assert await asyncio.wait_for(silent[0][0].read(), 0.5) == b""  # long before its deadline
        for reader, _writer in silent[1:]:  # the others at the deadline from their accept
            assert await asyncio.wait_for(reader.read(), 5) == b""
        assert 1.5 < loop.time() - started < 4
        assert endpoint.slots.unproved == 0
        for _reader, writer in silent:
            writer.close()
    _serving(test, connections=4, deadline=1.5)


def test_caps_are_fitted_under_the_descriptor_budget():
    caps = {"--max-connections": 4096, "--max-unproved": 256, "metrics connections": 64}
    assert fit_caps(caps, "--max-connections", 10_000) == caps
    assert fit_caps(caps, "--max-connections", 1024 - 256)["--max-connections"] == 1024 - 256 - 256 - 64
    assert fit_caps(caps, "--max-connections", 64 + 320)["--max-connections"] == 64
    with pytest.raises(ValueError, match=r"leaves room for 63 of the 4096 connections --max-connections asks.*"
                                         r"ulimit -n"):
        fit_caps(caps, "--max-connections", 63 + 320)
    assert fit_caps({**caps, "--max-connections": 10}, "--max-connections", 330)["--max-connections"] == 10
