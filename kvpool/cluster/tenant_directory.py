"""The tenants' records in etcd (kvpool/protocol/tenants.py): kept current in a server, and changed by an operator.

`TenantDirectory` keeps a Verifier's `tenants` equal to the records under cluster_layout.tenants_prefix: it
watches the prefix and reads it whole again on every change and after any failure (records are few), so a
rotation or deletion reaches every master and node a watch event after it is made; `on_change()` then ends
the connections whose token lapsed. Until its first read a server knows no tenant (their tokens are refused),
so a tenant is never served on a record it has not read.

`TenantRecords` makes the changes (create, set, rotate, delete), each one etcd transaction on the record's
revision, so two operators at once cannot lose one's change.
"""

import asyncio
import json
import logging
import time

import aetcd

from kvpool.errors import InvalidArgumentError, KeyExistsError, KeyNotFoundError, UnavailableError
from kvpool.cluster.etcd_client import follow_prefix
from kvpool.protocol import cluster_layout
from kvpool.protocol.tenants import LIMITS, MAX_TENANTS, TenantRecord, name_problem, record_problem

log = logging.getLogger(__name__)

RETRY_DELAY = 0.5
CALL_TIMEOUT = 5.0  # one etcd call: a silent etcd is found by the clock


async def _answered(call, what: str):
    """What the etcd `call` answers, within CALL_TIMEOUT; else UnavailableError."""
    try:
        return await asyncio.wait_for(call, CALL_TIMEOUT)
    except TimeoutError:
        raise UnavailableError(f"etcd did not answer {what} within {CALL_TIMEOUT:g} s; try again once it does") \
            from None


async def read_records(etcd: aetcd.Client, cluster: str) -> dict[str, TenantRecord]:
    """Every tenant's record, by name; a record etcd holds that does not parse is left out (and logged)."""
    records = {}
    for kv in await _answered(etcd.get_prefix(cluster_layout.tenants_prefix(cluster)), "a read of the tenants"):
        try:
            record = TenantRecord.from_json(kv.value)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("ignored the tenant record at %s: %s", kv.key.decode(errors="replace"), exc)
            continue
        records[record.name] = record
    return records


class TenantDirectory:
    """Keeps verifier.tenants current from etcd (run() until cancelled); on_change() after each change that was
    applied."""

    def __init__(self, etcd: aetcd.Client, cluster: str, verifier, on_change=lambda: None,
                 retry_delay: float = RETRY_DELAY):
        self._etcd = etcd
        self._cluster = cluster
        self._prefix = cluster_layout.tenants_prefix(cluster)
        self.verifier = verifier
        self.on_change = on_change
        self.retry_delay = retry_delay

    async def run(self) -> None:
        await follow_prefix(self._etcd, self._prefix, self._read, self.retry_delay, "tenant watch")

    async def _read(self) -> None:
        records = await read_records(self._etcd, self._cluster)
        changed = records != self.verifier.tenants
        self.verifier.tenants = records
        if changed:
            try:
                self.on_change()
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the watch
                log.exception("a tenant change listener failed")


class TenantRecords:
    """An operator's changes to the tenants' records (the master's Tenants RPC makes them)."""

    def __init__(self, etcd: aetcd.Client, cluster: str):
        self._etcd = etcd
        self._cluster = cluster

    async def _get(self, name: str) -> tuple[TenantRecord, int]:
        """(its record, its mod revision); KeyNotFoundError if there is none."""
        _check_name(name)
        found = await _answered(self._etcd.get(cluster_layout.tenant_key(self._cluster, name)), f"a read of {name}")
        if found is None:
            raise KeyNotFoundError(f"no tenant {name!r}")
        return TenantRecord.from_json(found.value), found.mod_revision

    async def _swap(self, record: TenantRecord, revision: int) -> TenantRecord:
        """Store `record` if its key is still at `revision` (0: absent); else the typed error why not."""
        problem = record_problem(record)
        if problem:
            raise InvalidArgumentError(problem)
        key = cluster_layout.tenant_key(self._cluster, record.name)
        tx = self._etcd.transactions
        compare = [tx.mod(key) == revision] if revision else [tx.version(key) == 0]
        succeeded, _ = await _answered(self._etcd.transaction(
            compare=compare, success=[tx.put(key, record.to_json())], failure=[]), f"a change of {record.name}")
        if not succeeded:
            if not revision:
                raise KeyExistsError(f"tenant {record.name!r} exists already")
            raise UnavailableError(f"tenant {record.name!r} was changed meanwhile by someone else; try again")
        return record

    async def create(self, name: str, limits: dict) -> TenantRecord:
        _check_name(name)
        if len(await read_records(self._etcd, self._cluster)) >= MAX_TENANTS:
            raise InvalidArgumentError(f"a cluster holds at most {MAX_TENANTS} tenants")
        return await self._swap(TenantRecord(name, 1, created=time.time(), **_limits(limits)), 0)

    async def set(self, name: str, limits: dict) -> TenantRecord:
        record, revision = await self._get(name)
        fields = {**record.limits(), **_limits(limits)}
        return await self._swap(TenantRecord(name, record.version, created=record.created, **fields), revision)

    async def rotate(self, name: str) -> TenantRecord:
        record, revision = await self._get(name)
        return await self._swap(TenantRecord(name, record.version + 1, created=record.created, **record.limits()),
                                revision)

    async def delete(self, name: str) -> TenantRecord:
        record, revision = await self._get(name)
        key = cluster_layout.tenant_key(self._cluster, name)
        tx = self._etcd.transactions
        succeeded, _ = await _answered(self._etcd.transaction(
            compare=[tx.mod(key) == revision], success=[tx.delete(key)], failure=[]), f"the deletion of {name}")
        if not succeeded:
            raise UnavailableError(f"tenant {name!r} was changed meanwhile by someone else; try again")
        return record


def _check_name(name: str) -> None:
    problem = name_problem(name)
    if problem:
        raise InvalidArgumentError(problem)


def _limits(given: dict) -> dict:
    """The limits an operator gave (only those LIMITS names), as ints."""
    unknown = set(given) - set(LIMITS)
    if unknown:
        raise InvalidArgumentError(f"unknown tenant limits {sorted(unknown)}; known: {', '.join(LIMITS)}")
    try:
        return {name: int(value) for name, value in given.items()}
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"tenant limits must be whole numbers of bytes: {json.dumps(given)}") from None
