"""The master's etcd lease, refreshed from a thread of its own over etcd's JSON gateway.

A master's event loop can be busy for a second or more (adopting a large inventory, a burst of
calls). A lease refreshed on that loop could lapse for that alone, and a leader would lose its term
to a busy moment, or refuse calls meanwhile. A refresh needs no loop: one small HTTP request every
ttl/3, made here by a thread that runs whenever the loop's Python work lets go of the interpreter
(every few milliseconds). etcd takes a lease refresh without authentication: the lease id is what
names it. What a refresh learns goes to the Election (election.py) through three callbacks.
"""

import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

log = logging.getLogger(__name__)


class GatewayLease:
    """Refreshes a lease by POST /v3/lease/keepalive on an etcd endpoint (HOST:PORT)."""

    def __init__(self, endpoint: str, context: ssl.SSLContext | None = None):
        self._url = f"{'https' if context is not None else 'http'}://{endpoint}/v3/lease/keepalive"
        self._context = context

    def refresh(self, lease_id: int, timeout: float) -> int:
        """The lease's remaining ttl in seconds (0: etcd no longer has it); OSError or ValueError when
        etcd does not answer in `timeout` or answers something else."""
        request = urllib.request.Request(self._url, data=json.dumps({"ID": str(lease_id)}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(request, timeout=timeout, context=self._context) as reply:
            body = json.loads(reply.read().split(b"\n", 1)[0] or b"{}")
        result = body.get("result")
        if not isinstance(result, dict):  # an error reply: {"error": {...}}
            raise ValueError(f"etcd lease keepalive answered {str(body)[:200]}")
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
            except (OSError, ValueError, urllib.error.URLError) as exc:
                if not self._stop.is_set():
                    self._failed(exc)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug here must not end the refreshing
                log.error("lease refresh failed unexpectedly", exc_info=exc)
                self._failed(exc)
                continue
            if not self._stop.is_set():
                self._answered(lease_id, asked, ttl_left)
