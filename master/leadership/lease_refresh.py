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
import functools
import threading
import time
from collections.abc import Callable

from kvpool.protocol.cluster_layout import parse_hostport

log = logging.getLogger(__name__)

RETRY_DELAY = 0.5  # after a refresh that failed: the lease runs out meanwhile


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
    """Calls `refresh(lease_id, timeout)` every `period` seconds (again after RETRY_DELAY when one failed) on a
    daemon thread, for the lease `lease_id()` names (None: none now, e.g. the loop that wants it is stuck);
    each outcome to answered(lease_id, asked_at, ttl_left) or failed(lease_id, exc), from that thread."""

    def __init__(self, refresh: Callable[[int, float], int], lease_id: Callable[[], int | None], period: float,
                 answered: Callable[[int, float, int], None], failed: Callable[[int, BaseException], None]):
        self._refresh = refresh
        self._lease_id = lease_id
        self.period = period
        self._answered = answered
        self._failed = failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="master-lease-refresh", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        pause = self.period
        while not self._stop.wait(pause):
            asked = time.monotonic()  # etcd counts the ttl from no earlier than this
            pause = self.period
            lease_id = self._lease_id()
            if lease_id is None:
                continue
            try:
                ttl_left = self._refresh(lease_id, self.period)
            except Exception as exc:  # noqa: BLE001 - no answer, or a bad one: tried again soon
                if not isinstance(exc, (OSError, ValueError)):
                    log.error("lease refresh failed unexpectedly", exc_info=exc)
                outcome = functools.partial(self._failed, lease_id, exc)
                pause = min(RETRY_DELAY, self.period)
            else:
                outcome = functools.partial(self._answered, lease_id, asked, ttl_left)
                pause = max(0.0, asked + self.period - time.monotonic())
            if self._stop.is_set():
                return
            try:
                outcome()
            except Exception as exc:  # noqa: BLE001 - e.g. the loop closed under a master stopping
                log.debug("lease refresh outcome not delivered: %s", exc)
