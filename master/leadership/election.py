"""Which master leads a cluster: a campaign on one etcd key, attached to each master's lease.

The leader's key is cluster_layout.master_key (so clients that look the master up
in etcd find the leader). A master wins by creating it in a transaction that
succeeds only if the key does not exist; its term is the key's creation revision,
which etcd makes strictly larger for every later winner. The key lives under the
winner's lease: a leader that dies stops refreshing it, etcd deletes the key after
the ttl, and the followers (watching it) campaign again. A clean stop revokes the
lease, so a follower takes over at once.

Every master, leader or not, also keeps /kvpool/<cluster>/masters/<id> under its
lease, so Stats can list the followers.
"""

import asyncio
import contextlib
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

import aetcd
from aetcd.rtypes import EventKind

from kvpool.cluster.etcd_client import follow_prefix
from kvpool.protocol import cluster_layout

from kvpool.master.leadership.lease_refresh import LeaseRefresher

log = logging.getLogger(__name__)

RETRY_DELAY = 0.5
LEASE_MARGIN = 0.2  # part of the ttl a leader gives up early, against scheduling delays and clock drift
LOOP_STALL = 3  # ttls the event loop may go without running the lease task before the lease is let go


def control_address_of(value: bytes) -> str:
    """The control port a master's etcd value names ("" if none: a master without one)."""
    try:
        return str(json.loads(value).get("control_address") or "")
    except (ValueError, AttributeError):
        return ""


class LeadershipState(Protocol):
    """What the rest of the master reads of the election: the service's gate and Stats, the
    health service, the key feed. Election is the one implementation."""

    is_leader: bool      # won the election and holds the leader's key
    serving: bool        # leads and has taken over (lifecycle.py sets it): requests are answered only then
    term: int            # this master's term while it leads
    leader_term: int     # the current leader's term, as last seen
    leader_address: str  # the leader's gRPC address ("" while nobody leads, as far as this master knows)
    leader_control_address: str  # the leader's control port ("" if unknown or not offered)
    members: list[str]   # addresses of every registered master

    def holds_lease(self) -> bool: ...

    def etcd_in_doubt(self, window: float) -> bool: ...

    def etcd_silent(self) -> bool: ...

    def answering(self) -> bool: ...


class Election:
    """Campaigns for the leader's key and keeps this master's lease (LeadershipState is what
    the rest of the master may read of it)."""

    def __init__(self, etcd: aetcd.Client, cluster: str, master_id: str, address: str, ttl: int = 5,
                 control_address: str = "", refresh: Callable[[int, float], int] | None = None):
        """refresh: refresh(lease_id, timeout) -> ttl left, blocking (lease_refresh.GatewayLease.refresh): the
        lease is then refreshed on a thread of its own, whatever this master's loop is busy with; else on
        the loop."""
        self._etcd = etcd
        self._refresh = refresh
        self._refresher: LeaseRefresher | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reregister = False  # a follower's lease is gone: register again (on the loop)
        self._lease_lock = threading.Lock()  # the refresh thread's check-and-note against a lease replaced
        self._loop_beat = 0.0  # when the lease task last ran on the loop: a loop stuck for good lets the lease go
        self.key = cluster_layout.master_key(cluster)
        self._members_prefix = cluster_layout.masters_prefix(cluster)
        self._member_key = self._members_prefix + master_id.encode()
        self._value = json.dumps({"address": address, "master_id": master_id,
                                  "control_address": control_address}).encode()
        self.address = address
        self.ttl = max(2, math.ceil(ttl))  # etcd grants whole seconds, at least 2
        self._lease = None
        self._refreshed = 0.0  # monotonic time of the last refresh etcd confirmed
        self._etcd_back = float("-inf")  # when etcd last answered after a silence (a refresh late, a lease lost)
        # etcd was asked (a refresh, registering again) and did not answer in time; cleared by an answer. A
        # refresh late only because this master's loop was busy is not that: callers then retry, not give up.
        self._asked_unanswered = False
        self._task: asyncio.Task | None = None
        self.is_leader = False
        self.term = 0         # this master's term while it leads
        self.leader_term = 0  # the current leader's term, as last seen
        self.leader_address = ""  # "" while nobody leads (as far as this master knows)
        self.leader_control_address = ""  # the leader's control port ("" if unknown or not offered)
        self.members: list[str] = [address]  # addresses of every registered master
        self._members_task: asyncio.Task | None = None
        self.lost = asyncio.Event()  # set when this master led and no longer does
        self.serving = False  # leads and has taken over: the service answers only then (lifecycle.py)

    @property
    def followers(self) -> list[str]:
        return sorted(a for a in self.members if a != self.leader_address)

    # ----- lease -----

    async def start(self) -> None:
        """Take a lease and register as a master of the cluster (leading or not)."""
        asked = time.monotonic()
        self._lease = await self._etcd.lease(self.ttl)
        self._refreshed = asked
        await self._etcd.put(self._member_key, self._value, lease=self._lease)
        await self._read_members()
        self._loop = asyncio.get_running_loop()
        self._loop_beat = time.monotonic()
        if self._refresh is not None:
            try:  # one refresh through the gateway first: without it, refresh on the loop
                await asyncio.wait_for(asyncio.to_thread(self._refresh, self._lease.id, self.ttl / 3), self.ttl)
            except Exception as exc:  # noqa: BLE001 - no gateway (disabled, a gRPC-only proxy): the loop refreshes
                log.warning("etcd's JSON gateway did not refresh the lease (%s: %s); refreshing it on the event "
                            "loop instead", type(exc).__name__, exc)
            else:
                self._refresher = LeaseRefresher(self._refresh, self._lease_to_refresh, self.ttl / 3,
                                                 self._refreshed_on_thread, self._refresh_failed)
                self._refresher.start()
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name="master-lease")
        self._members_task = asyncio.get_running_loop().create_task(self._watch_members(), name="master-members")

    async def _watch_members(self) -> None:
        """Keep `members` current as masters come and go, so Stats names every master a client may
        fail over to from the moment it registers (the lease loop re-reads them too, as a backstop)."""
        await follow_prefix(self._etcd, self._members_prefix, self._read_members, RETRY_DELAY, "master watch")

    async def _read_members(self) -> None:
        members = []
        for kv in await self._etcd.get_prefix(self._members_prefix):
            with contextlib.suppress(ValueError, KeyError, TypeError):
                members.append(json.loads(kv.value)["address"])
        self.members = sorted(set(members) | {self.address})

    async def _keep_alive(self) -> None:
        """Refresh the lease every ttl/3 (unless a thread does: lease_refresh.py), and read the members.
        Each refresh (and the members' read) is bounded by the clock: a silent etcd never answers, and this
        master steps down by its own clock, not etcd's."""
        pause = self.ttl / 3
        while True:
            await asyncio.sleep(pause)
            pause = self.ttl / 3
            self._loop_beat = time.monotonic()
            try:
                if self._refresher is None:
                    asked = time.monotonic()  # etcd counts the ttl from no earlier than this
                    reply = await asyncio.wait_for(self._etcd.refresh_lease(self._lease.id), self.ttl / 3)
                    if self._refreshed_at(asked, reply.TTL if reply is not None else 0):
                        self._lease_gone(self._lease.id)
                if self._reregister:
                    # A follower just registers again; it had nothing to lose.
                    lease = await asyncio.wait_for(self._etcd.lease(self.ttl), self.ttl)
                    await asyncio.wait_for(self._etcd.put(self._member_key, self._value, lease=lease), self.ttl)
                    with self._lease_lock:
                        self._lease, self._reregister = lease, False
                await asyncio.wait_for(self._read_members(), self.ttl / 3)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd away: a leader that cannot refresh steps down
                if self._refresher is None:
                    self._refresh_failed(self._lease.id, exc)
                else:  # the thread judges the lease; reading the members may fail for a busy loop alone
                    log.debug("reading the masters failed (%s: %s)", type(exc).__name__, exc)
                if self.is_leader:
                    pause = RETRY_DELAY  # try again soon: the lease runs out meanwhile
            if self.is_leader and time.monotonic() - self._refreshed > self.ttl:
                self._lease_expired()

    def _refreshed_at(self, asked: float, ttl_left: int) -> bool:
        """etcd answered a refresh asked at `asked`; whether the lease is gone (ttl_left 0)."""
        self._asked_unanswered = False  # an answer, if not the one hoped for
        if ttl_left <= 0:
            self._etcd_back = time.monotonic()
            return True
        if asked - self._refreshed > self.ttl / 2:
            self._etcd_back = time.monotonic()
        self._refreshed = max(self._refreshed, asked)
        return False

    def _lease_to_refresh(self) -> int | None:
        """The lease the thread refreshes; None once this master's loop has not run its lease task for
        LOOP_STALL ttls (stuck for good, not busy): the lease then lapses and a follower takes over."""
        if time.monotonic() - self._loop_beat > LOOP_STALL * self.ttl:
            return None
        return self._lease.id

    def _refreshed_on_thread(self, lease_id: int, asked: float, ttl_left: int) -> None:
        with self._lease_lock:
            if self._lease is None or lease_id != self._lease.id:
                return  # a lease replaced meanwhile (registered again)
            gone = self._refreshed_at(asked, ttl_left)
        if gone:
            self._loop.call_soon_threadsafe(self._lease_gone, lease_id)

    def _refresh_failed(self, lease_id: int, exc: BaseException) -> None:
        if self._lease is None or lease_id != self._lease.id:
            return
        log.warning("refreshing the master lease failed (%s: %s)", type(exc).__name__, exc)
        self._asked_unanswered = True

    def _lease_gone(self, lease_id: int) -> None:
        """etcd no longer has this master's lease: a leader steps down, a follower registers again."""
        if self._lease is None or lease_id != self._lease.id:
            return
        self._lease_expired()
        if not self.is_leader and not self.lost.is_set():
            self._reregister = True

    def holds_lease(self) -> bool:
        """Whether this master leads with a lease etcd cannot have expired yet, by this master's own
        clock (LEASE_MARGIN of the ttl before it could have). Checked on every request and by the
        health service: a leader that cannot refresh (etcd silent, or its host cut off) stops
        answering and claiming leadership before a successor may lead, since the successor rebuilds
        its table from the nodes at that moment."""
        return self.is_leader and time.monotonic() < self._refreshed + self.ttl * (1 - LEASE_MARGIN)

    def etcd_in_doubt(self, window: float) -> bool:
        """Whether etcd is silent to this master now (its lease not refreshed for half a ttl), or was
        within the last `window` seconds: leases of others may have expired for that silence alone."""
        now = time.monotonic()
        return now - self._refreshed > self.ttl / 2 or now - self._etcd_back < window

    def etcd_silent(self) -> bool:
        """Whether etcd, asked, has not answered this master since (not merely: its lease is late)."""
        return self._asked_unanswered

    def answering(self) -> bool:
        """Whether this master may answer requests now: it has taken over and its lease holds."""
        return self.serving and self.holds_lease()

    def _lease_expired(self) -> None:
        if self.is_leader:
            log.error("the leader's lease (term %d) expired; this master no longer leads", self.term)
            self.step_down()

    def step_down(self) -> None:
        """Stop leading now (the lease expired, or etcd refused a fenced write)."""
        if self.is_leader:
            self.is_leader = False
            self.leader_address = ""
            self.lost.set()

    async def rejoin(self) -> None:
        """After losing the leadership: clear this master's old claim and register under a fresh
        lease, so it can campaign again (retried until etcd answers).

        The old lease may outlive the outage (etcd restores leases when it restarts), and with it
        the leader's key of the lost term, which would block every campaign; that key is deleted
        only if it is still the one created at the lost term."""
        old_term, old_lease = self.term, self._lease
        tx = self._etcd.transactions
        while True:
            try:
                await asyncio.wait_for(self._etcd.transaction(
                    compare=[tx.create(self.key) == old_term], success=[tx.delete(self.key)], failure=[]),
                    self.ttl)
                if old_lease is not None:
                    with contextlib.suppress(Exception):  # most likely expired already
                        await asyncio.wait_for(self._etcd.revoke_lease(old_lease.id), self.ttl)
                asked = time.monotonic()
                lease = await asyncio.wait_for(self._etcd.lease(self.ttl), self.ttl)
                await asyncio.wait_for(self._etcd.put(self._member_key, self._value, lease=lease), self.ttl)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd away: try again
                log.warning("registering again failed (%s: %s); retrying", type(exc).__name__, exc)
                self._asked_unanswered = True
                await asyncio.sleep(RETRY_DELAY)
        with self._lease_lock:
            self._lease = lease
            self._refreshed = asked
            self._etcd_back = time.monotonic()
            self._asked_unanswered = False
        self.lost.clear()  # armed again for the next term
        log.info("registered again; campaigning")

    # ----- campaign -----

    async def campaign(self, give_up_after: float | None = None) -> bool:
        """Until this master leads (True), or `give_up_after` seconds passed without winning (False).

        While another master leads, leader_address names it."""
        loop = asyncio.get_running_loop()
        deadline = None if give_up_after is None else loop.time() + give_up_after
        while True:
            try:
                if await self._try_win():
                    return True
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return False
                try:
                    await asyncio.wait_for(self._until_vacant(), remaining)
                except TimeoutError:
                    return False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - etcd away: try again
                log.warning("campaign failed (%s: %s); retrying", type(exc).__name__, exc)
                await asyncio.sleep(RETRY_DELAY)

    async def _try_win(self) -> bool:
        tx = self._etcd.transactions
        succeeded, _ = await self._etcd.transaction(
            compare=[tx.create(self.key) == 0],
            success=[tx.put(self.key, self._value, lease=self._lease)], failure=[])
        record = await self._etcd.get(self.key)
        if record is None:
            return False  # won and lost at once (lease gone): campaign again
        if succeeded and record.lease == self._lease.id:
            self.term = self.leader_term = record.create_revision
            self.is_leader = True
            self.leader_address = self.address
            self.leader_control_address = control_address_of(self._value)
            log.info("leading with term %d", self.term)
            return True
        self._note_leader(record.value, record.create_revision)
        return False

    def _note_leader(self, value: bytes, term: int) -> None:
        self.leader_term = term
        try:
            self.leader_address = json.loads(value)["address"]
        except (ValueError, KeyError, TypeError):
            self.leader_address = ""
        self.leader_control_address = control_address_of(value)

    async def _until_vacant(self) -> None:
        """Until the leader's key is deleted (following who holds it meanwhile)."""
        record = await self._etcd.get(self.key)
        if record is None:
            self.leader_address = ""
            return
        self._note_leader(record.value, record.create_revision)
        watch = await self._etcd.watch(self.key, start_revision=record.mod_revision + 1)
        try:
            async for event in watch:
                if event.kind == EventKind.DELETE:
                    self.leader_address = ""
                    return
                self._note_leader(event.kv.value, event.kv.create_revision)
        finally:
            with contextlib.suppress(Exception):
                await watch.cancel()

    # ----- stop -----

    async def resign(self) -> None:
        """Give the leadership (and this master's registration) up at once."""
        if self._refresher is not None:
            self._refresher.stop()
        for task in (self._task, self._members_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self.is_leader = False
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._etcd.revoke_lease(self._lease.id), 3)
