"""The master's etcd lease, refreshed from a thread of its own over etcd's JSON gateway.

A master's event loop can be busy for a second or more (adopting a large inventory, a burst of
calls). A lease refreshed on that loop could lapse for that alone, and a leader would lose its term
to a busy moment, or refuse calls meanwhile. A refresh needs no loop: one small HTTP request every
ttl/3, made here by a thread that runs whenever the loop's Python work lets go of the interpreter
(every few milliseconds). etcd takes a lease refresh without authentication: the lease id is what
names it. What a refresh learns goes to the Election (election.py) through three callbacks.
"""

import http.client
import json
import logging
import ssl
import threading
import time
from collections.abc import Callable

from kvpool.protocol.cluster_layout import parse_hostport

log = logging.getLogger(__name__)


class GatewayLease:
    """Refreshes a lease by POST /v3/lease/keepalive on an etcd endpoint (HOST:PORT), on a connection of its
    own each time (no proxy; a connection a partition left dead is never reused)."""

    def __init__(self, endpoint: str, context: ssl.SSLContext | None = None):
        host, port = parse_hostport(endpoint)
        self._host, self._port, self._context = host, port, context

    def refresh(self, lease_id: int, timeout: float) -> int:
        """The lease's remaining ttl in seconds (0: etcd no longer has it); OSError or ValueError when
        etcd does not answer in `timeout` or answers something else."""
        if self._context is not None:
            connection = http.client.HTTPSConnection(self._host, self._port, timeout=timeout, context=self._context)
        else:
            connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            connection.request("POST", "/v3/lease/keepalive", json.dumps({"ID": str(lease_id)}),
                               {"Content-Type": "application/json"})
            reply = connection.getresponse()
            body = reply.read()
        except http.client.HTTPException as exc:
            raise ValueError(f"etcd lease keepalive: {exc}") from None
        finally:
            connection.close()
        if reply.status != 200:
            raise ValueError(f"etcd lease keepalive answered HTTP {reply.status}: {body[:200]!r}")
        result = json.loads(body.split(b"\n", 1)[0] or b"{}").get("result")
        if not isinstance(result, dict):  # an error reply: {"error": {...}}
            raise ValueError(f"etcd lease keepalive answered {body[:200]!r}")
        return int(result.get("TTL", 0))  # proto3 JSON leaves a zero out: no TTL is a lease gone


class LeaseRefresher:
    """Calls `refresh(lease_id(), timeout)` every `period` seconds on a daemon thread; each outcome to
    answered(lease_id, asked_at, ttl_left) or failed(exc), from that thread."""

    def __init__(self, refresh: Callable[[int, float], int], lease_id: Callable[[], int], period: float,
                 answered: Callable[[int, float, int], None], failed: Callable[[BaseException], None]):
        self._refresh = refresh
        self._lease_id = lease_id
        self.period = period
        self._answered = answered
        self._failed = failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="master-lease-refresh", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            asked = time.monotonic()  # etcd counts the ttl from no earlier than this
            lease_id = self._lease_id()
            try:
                ttl_left = self._refresh(lease_id, self.period)
            except (OSError, ValueError) as exc:
                if not self._stop.is_set():
                    self._failed(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the refreshing
                log.error("lease refresh failed unexpectedly", exc_info=exc)
                self._failed(exc)
                continue
            if not self._stop.is_set():
                self._answered(lease_id, asked, ttl_left)
