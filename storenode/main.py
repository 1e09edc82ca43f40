"""`python -m kvpool.storenode`: run one storage node until SIGTERM/SIGINT."""

import argparse
import asyncio
import logging
import os
import re
import secrets
import shutil
import signal
import sys
import uuid


from kvpool.security import auth, tls
from kvpool.cluster.etcd_client import OpenEtcdError, add_open_etcd_argument
from kvpool.cluster.tenant_directory import TenantDirectory
from kvpool.runtime import config
from kvpool.protocol import transports
from kvpool.protocol.cluster_layout import DEFAULT_CLUSTER, SHARED_TIER, NodeRecord, TierRecord, parse_hostport
from kvpool.errors import KvpoolError, UnavailableError
from kvpool.runtime.health import HTTP_CONNECTIONS, Health, serve_http
from kvpool.runtime.process import (cannot_listen, cannot_reach_etcd, descriptor_budget, fit_caps, memory_limit,
                                    run_server, version_line)
from kvpool.protocol.units import format_size, parse_size
from kvpool.objectstore.bucket import Bucket
from kvpool.objectstore.settings import settings_for
from kvpool.objectstore.stacked import StackedTier
from kvpool.objectstore.tier import BucketTier
from kvpool.sharedfs.files import DeepTier, SharedDir
from kvpool.sharedfs.file_gate import FileGate

from kvpool.storenode.storage import policy
from kvpool.storenode.storage.dram import DramSegment, remove_stale_segments, segment_name
from kvpool.storenode.background.maintenance import Maintenance
from kvpool.storenode.background.stop_keep import STOP_GRACE, keep_on_stop
from kvpool.storenode.background.stop_handoff import hand_off_on_stop
from kvpool.storenode.serving.metrics import NodeMetrics
from kvpool.storenode.storage.recovery import recover
from kvpool.storenode.background.registration import NodeRegistration
from kvpool.storenode.serving.tcp_server import FRAME_TIMEOUT, MAX_CONNECTIONS, MAX_UNPROVED, MAX_UNPROVED_PER_ADDRESS, DataServer
from kvpool.storenode.background.shared_tier import TIMEOUT as SHARED_TIMEOUT, SharedTier
from kvpool.storenode.storage.ssd import SsdSegment
from kvpool.storenode.storage.store import ObjectStore
from kvpool.storenode.storage.tenant_shares import TenantShares, capacity_of
from kvpool.storenode.storage.tiers import StorageTier
from kvpool.storenode.serving.ucx_server import start_ucx

log = logging.getLogger("kvpool.storenode")

# Node ids and cluster names become etcd key segments and /dev/shm file names.
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


OBJECT_STORE_CAPACITY = 1 << 40  # a bucket's share of the shared tier unless --shared-capacity says otherwise

def _name(text: str) -> str:
    if not _NAME.match(text):
        raise argparse.ArgumentTypeError(f"{text!r}: use only letters, digits, '.', '_' and '-'")
    return text


def _positive_size(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size <= 0:
        raise argparse.ArgumentTypeError("size must be positive")
    return size


def _hostport(text: str) -> str:
    try:
        parse_hostport(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError("must be in (0, 1]")
    return value


def _transports(text: str) -> tuple[str, ...]:
    try:
        return transports.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool storenode", description="Run a kvpool storage node.")
    p.add_argument("--version", action="version", version=version_line("kvpool-storenode"))
    config.add_config_option(p)
    p.add_argument("--etcd", required=True, type=_hostport, metavar="HOST:PORT", help="etcd client endpoint")
    p.add_argument("--dram", required=True, type=_positive_size, metavar="SIZE",
                   help="DRAM segment size, e.g. 1GiB")
    p.add_argument("--ssd", type=_size, default=0, metavar="SIZE", help="SSD segment size (0: no SSD tier)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--advertise-host", default=None,
                   help="address clients use to reach this node (default: --host); needed with --host 0.0.0.0")
    p.add_argument("--port", type=int, default=0, help="data port (0: any free port)")
    p.add_argument("--cluster", type=_name, default=DEFAULT_CLUSTER)
    p.add_argument("--node-id", type=_name, default=None, help="default: node-<random hex>")
    p.add_argument("--data-dir", default=None, help="node-local files; needed with --ssd (unless --ssd-dir)")
    p.add_argument("--ssd-dir", default=None, help="directory of the SSD segment file (default: DATA_DIR/ssd)")
    p.add_argument("--shared-dir", default=None, metavar="PATH",
                   help="a directory every node mounts (NFS, CephFS, a FUSE mount): the shared tier, below the "
                        "node's last tier and kept when every node is gone")
    p.add_argument("--object-store", default=None, metavar="s3://BUCKET/PREFIX",
                   help="an S3-compatible bucket as the shared tier, or beneath --shared-dir (endpoint, region and "
                        "credentials as the AWS tools read them: AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID "
                        "/ AWS_SECRET_ACCESS_KEY or the shared credentials file); ?encryption=aes-gcm after it "
                        "encrypts what is written there (a key from the cluster secret)")
    p.add_argument("--shared-capacity", type=_size, default=0, metavar="SIZE",
                   help="bytes the leader keeps the shared tier within (0: the free space of its file system "
                        f"when the node starts; of a bucket, {OBJECT_STORE_CAPACITY >> 40} TiB)")
    p.add_argument("--shared-timeout", type=float, default=SHARED_TIMEOUT, metavar="SECONDS",
                   help="seconds one call into the shared tier's file system may take (default "
                        f"{SHARED_TIMEOUT:g}): past it, or at an I/O error, the tier is skipped until a probe "
                        "answers (a mount whose server hangs never holds the node)")
    p.add_argument("--stop-grace", type=float, default=STOP_GRACE, metavar="SECONDS",
                   help="on SIGTERM / SIGINT, seconds a node spends keeping what it holds before it leaves: written "
                        "to its shared tier, or without one copied to other nodes with room (the leader drains it) "
                        f"(default {STOP_GRACE:g}: within Kubernetes' default 30 s termination grace; 0: leave at "
                        "once; a second signal leaves at once)")
    p.add_argument("--shared-dir-share", type=_size, default=0, metavar="SIZE",
                   help="with both --shared-dir and --object-store: bytes of its own files this node keeps in the "
                        "directory before moving the oldest on to the bucket (0: a quarter of the directory's "
                        "free space when the node starts)")
    # A narrow band: giving up victims costs a step each (eviction_order.py), so relieving a tier
    # far below its high watermark would only throw away cached objects.
    p.add_argument("--high-watermark", type=_fraction, default=0.95,
                   help="fraction of a tier above which it is relieved (default 0.95)")
    p.add_argument("--low-watermark", type=_fraction, default=0.9,
                   help="fraction a relieved tier is brought down to (default 0.9)")
    p.add_argument("--policy", choices=policy.POLICIES, default=policy.LRU,
                   help="which objects go first: least recently or least frequently used")
    p.add_argument("--promote-after", type=int, default=2, metavar="N",
                   help="SSD reads within --promote-window that copy an object to DRAM (default 2)")
    p.add_argument("--promote-window", type=float, default=60.0, metavar="SECONDS")
    p.add_argument("--hard-pin-quota", type=_size, default=None, metavar="SIZE",
                   help="bytes of hard-pinned objects allowed (default: half of --dram)")
    p.add_argument("--max-hold", type=float, default=300.0, metavar="SECONDS", help="cap on one HOLD")
    p.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                   help="data connections that proved their credential served at once; more get an UNAVAILABLE "
                        "reply and are closed (lowered to fit the descriptor limit, which the node raises to "
                        "its hard limit, with a reserve)")
    p.add_argument("--max-unproved", type=int, default=MAX_UNPROVED, metavar="N",
                   help="data connections still in their handshake at once, apart from --max-connections; past "
                        "it a new one displaces the oldest unproved one")
    p.add_argument("--max-unproved-per-address", type=int, default=MAX_UNPROVED_PER_ADDRESS, metavar="N",
                   help="of --max-unproved, from one peer address; past it a new one displaces the oldest of "
                        "that address")
    p.add_argument("--frame-timeout", type=float, default=FRAME_TIMEOUT, metavar="SECONDS",
                   help="a request half-received with no byte for this long closes its connection and frees "
                        "what it reserved; a connection must also prove its credential within this long of "
                        "connecting")
    p.add_argument("--idle-timeout", type=float, default=0.0, metavar="SECONDS",
                   help="close a data connection that sends no request for this long (default 0: never, as "
                        "clients keep theirs open; --max-connections bounds how many there are)")
    p.add_argument("--lease-ttl", type=float, default=5.0, metavar="SECONDS",
                   help="etcd lease TTL; the master drops the node this long after it dies")
    p.add_argument("--etcd-wait", type=float, default=30.0, metavar="SECONDS",
                   help="how long to keep trying to register while etcd is unreachable before giving up "
                        "(default 30)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus HTTP port (0: none)")
    p.add_argument("--zone", default="", help="failure domain of this node (rack, host, AZ): the master puts "
                                              "an object's replicas in distinct zones first (default: none)")
    # UCX is opt-in: without RDMA (none in the UCX wheels on PyPI) it moves bytes slower than our TCP.
    p.add_argument("--transports", type=_transports, default=(transports.SHM, transports.TCP), metavar="LIST",
                   help="data transports to offer: shm (clients on this host), ucx (needs kvpool[ucx]; worth it "
                        "with RDMA), tcp (always served) (default: shm,tcp)")
    auth.add_token_argument(p)
    add_open_etcd_argument(p)
    tls.add_tls_argument(p)
    return p


def _check(parser: argparse.ArgumentParser, args) -> None:
    if args.low_watermark >= args.high_watermark:
        parser.error("--low-watermark must be below --high-watermark")
    if args.ssd and not (args.data_dir or args.ssd_dir):
        parser.error("--ssd needs --data-dir (or --ssd-dir)")
    if args.promote_after < 1 or args.promote_window <= 0 or args.max_hold < 0:
        parser.error("--promote-after must be >= 1, --promote-window > 0 and --max-hold >= 0")
    if args.shared_dir_share and not (args.shared_dir and args.object_store):
        parser.error("--shared-dir-share is the directory's part of a shared tier over a bucket: give it with both "
                     "--shared-dir and --object-store")
    if not args.stop_grace >= 0:
        parser.error("--stop-grace must be 0 (leave at once) or positive seconds")
    if not args.shared_timeout > 0:  # also NaN
        parser.error("--shared-timeout must be positive seconds")
    if not args.frame_timeout > 0:  # also NaN
        parser.error("--frame-timeout must be positive")
    if not args.etcd_wait > 0:
        parser.error("--etcd-wait must be positive")
    if not args.idle_timeout >= 0:
        parser.error("--idle-timeout must be 0 (never) or positive")
    if min(args.max_connections, args.max_unproved, args.max_unproved_per_address) < 1:
        parser.error("--max-connections, --max-unproved and --max-unproved-per-address must be at least 1")
    caps = fit_caps({"--max-connections": args.max_connections, "--max-unproved": args.max_unproved,
                     "metrics connections": HTTP_CONNECTIONS}, "--max-connections", descriptor_budget())
    args.max_connections = caps["--max-connections"]
    memory, source = memory_limit()
    if args.dram > memory:  # the node would be killed (OOM, SIGBUS) once its DRAM fills, not refused now
        raise ValueError(f"--dram {format_size(args.dram)} is more than the {format_size(memory)} of memory "
                         f"{source}: give --dram a smaller size, or the node more memory")


def main(argv=None) -> int:
    parser = build_parser()
    args, _ = config.resolve(parser, "storenode", argv)
    try:
        _check(parser, args)
    except ValueError as exc:  # a limit of this machine's that leaves it unable to serve
        print(f"kvpool-storenode: {exc}", file=sys.stderr, flush=True)
        return 1
    args.secret = auth.secret_of(parser, args)
    args.tls = tls.files_of(parser, args)
    return run_server(_serve(args), fast_loop=True)  # SSD reads use kvpool/sockets/socket_output.py, not sock_sendfile


def _open_shared(args, node_id: str, instance: str) -> tuple[DeepTier | None, int]:
    """The shared tier's store: the directory this node mounts (--shared-dir) or the bucket (--object-store), or
    None; and the capacity it registers. OSError or ValueError if it cannot be used."""
    writer = f"{node_id}-{instance}"
    if args.object_store:
        bucket = Bucket(settings_for(args.object_store))
        tier = BucketTier(bucket, args.cluster, writer, args.secret)
        if args.shared_dir:  # the directory, the bucket beneath it
            share = args.shared_dir_share or shutil.disk_usage(args.shared_dir).free // 4
            tier = StackedTier(SharedDir(args.shared_dir, args.cluster, writer), tier, share)
        return tier, args.shared_capacity or OBJECT_STORE_CAPACITY
    if not args.shared_dir:
        return None, 0
    directory = SharedDir(args.shared_dir, args.cluster, writer)
    return directory, args.shared_capacity or shutil.disk_usage(args.shared_dir).free


def _open_tiers(args, node_id: str, instance: str):
    """(dram StorageTier, ssd StorageTier or None); OSError/ValueError/KvpoolError if one cannot be made."""
    for path in remove_stale_segments(args.cluster, node_id):
        log.info("removed %s left by an earlier run of this node", path)
    dram = StorageTier(DramSegment(args.dram, segment_name(args.cluster, node_id, instance)),
                       args.high_watermark, args.low_watermark)
    if not args.ssd:
        return dram, None
    try:
        ssd_dir = args.ssd_dir or os.path.join(args.data_dir, "ssd")
        segment = SsdSegment(ssd_dir, args.ssd)
        ssd = StorageTier(segment, args.high_watermark, args.low_watermark)
        ssd.watch(FileGate(f"SSD tier {ssd_dir}", segment.probe, threads=1))
    except BaseException:
        dram.segment.close()
        raise
    return dram, ssd


def _failing(store: ObjectStore, shared: SharedTier | None) -> str:
    """What /readyz says beside "ok" while a tier's disk or mount fails: the node still serves (DRAM, and the
    copies it can read), so it stays ready, and says what it skips."""
    failing = [f"{tier.name} tier fails: {tier.fault}" for tier in store.tiers if tier.fault]
    if shared is not None and shared.gate.fault:
        failing.append(f"shared tier fails: {shared.gate.fault}")
    return "; ".join(failing)


async def _serve(args) -> int:
    node_id = args.node_id or f"node-{secrets.token_hex(4)}"
    instance = uuid.uuid4().hex
    log.info("%s, node %s", version_line("kvpool-storenode"), node_id)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    try:
        shared_dir, shared_capacity = _open_shared(args, node_id, instance)
    except (OSError, ValueError) as exc:
        log.error("cannot use the shared tier %s: %s", args.shared_dir or args.object_store, exc)
        return 1
    try:
        dram, ssd = _open_tiers(args, node_id, instance)
    except (OSError, ValueError, KvpoolError) as exc:
        log.error("cannot set up the storage tiers: %s", exc)
        return 1
    quota = args.dram // 2 if args.hard_pin_quota is None else args.hard_pin_quota
    store = ObjectStore(dram, ssd, mode=args.policy, hard_pin_quota=quota, max_hold=args.max_hold,
                        promote_after=args.promote_after, promote_window=args.promote_window)
    maintenance = Maintenance(store)
    shared = SharedTier(shared_dir, store, shared_capacity, args.shared_timeout,
                        f"shared tier {args.shared_dir or args.object_store}") if shared_dir is not None else None
    maintenance.shared = shared
    metrics = NodeMetrics()
    metrics.track_tiers(store.tiers)
    metrics.track_tenants(store.tenants)
    if shared is not None:
        metrics.track_shared(shared)
    verifier = auth.Verifier(args.secret)
    auth.warn_if_open(verifier, "this storage node")
    credential = auth.Credential.for_member(args.secret) if args.secret else None
    server = DataServer(store, maintenance, node_id, metrics, instance=instance, verifier=verifier,
                        frame_timeout=args.frame_timeout, max_connections=args.max_connections,
                        credential=credential, tls=args.tls, idle_timeout=args.idle_timeout,
                        max_unproved=args.max_unproved, max_unproved_per_address=args.max_unproved_per_address,
                        shared=shared)
    if transports.SHM in args.transports and dram.segment.path:
        server.offers[transports.SHM] = {"size": dram.segment.capacity}
    metrics_http = None
    registration = None
    ucx = None
    followers: list[asyncio.Task] = []  # keep the tenants' records and this node's shares of them current
    health = Health()
    beat = loop.create_task(health.beat(), name="health-beat")
    try:
        if ssd:
            recover(store)
        maintenance.start()
        try:
            _, port = await server.start(args.host, args.port)
        except OSError as exc:
            print(cannot_listen("kvpool-storenode", args.host, args.port, "--port", exc), file=sys.stderr, flush=True)
            return 1
        if transports.UCX in args.transports:
            ucx = await start_ucx(store, server, args.host)
            if ucx is not None:
                server.offers[transports.UCX] = ucx.offer
        if args.metrics_port:
            metrics_http = await serve_http(args.metrics_port, args.host, metrics.registry, health)
        tiers = {tier.name: TierRecord(tier.segment.capacity, tier.segment.path) for tier in store.tiers}
        if shared is not None:  # the cluster's tier: the leader keeps it within the capacity given here
            tiers[SHARED_TIER] = TierRecord(shared.capacity, args.shared_dir or args.object_store)
        record = NodeRecord(node_id=node_id, instance=instance, host=args.advertise_host or args.host,
                            data_port=port, tiers=tiers, metrics_port=args.metrics_port, pid=os.getpid(),
                            zone=args.zone, transports=[*server.offers, transports.TCP],
                            transport_info=server.offers)
        registration = NodeRegistration(args.etcd, args.cluster, record, args.lease_ttl, credential, args.tls,
                                        allow_open=args.allow_etcd_without_auth)
        try:
            if not await _until_stopped(registration.start(args.etcd_wait), stopping):
                return 0
        except UnavailableError as exc:  # etcd did not take the registration before its deadline
            print(cannot_reach_etcd("kvpool-storenode", args.etcd, exc), file=sys.stderr, flush=True)
            return 1
        except OpenEtcdError as exc:
            print(f"kvpool-storenode: {exc}", file=sys.stderr, flush=True)
            return 1
        shares = TenantShares(registration.etcd, args.cluster, node_id, capacity_of(record), verifier, store)
        tenants = TenantDirectory(registration.etcd, args.cluster, verifier,
                                  on_change=lambda: _tenants_changed(server, shares))
        followers += [loop.create_task(tenants.run(), name="tenant-directory"),
                      loop.create_task(shares.run(), name="tenant-shares")]
        health.ready = lambda: (True, _failing(store, shared)) if registration.in_etcd() else (
            False, "etcd lease not refreshed within its ttl: the master may count this node gone")
        print(f"kvpool-storenode ready node_id={node_id} address={record.address}", flush=True)
        await stopping.wait()
        health.ready = lambda: (False, "stopping")
        log.info("stopping")
        if args.stop_grace > 0:
            stopping.clear()  # a second signal: leave at once
            keeping = keep_on_stop(store, shared, args.stop_grace) if shared is not None else hand_off_on_stop(
                store, registration.etcd, args.cluster, node_id, credential, args.tls, args.stop_grace)
            await _first(keeping, stopping.wait())
        return 0
    except (OSError, KvpoolError) as exc:
        log.error("storage node failed: %s", exc)
        return 1
    finally:
        for task in (beat, *followers):
            task.cancel()
        await asyncio.gather(*followers, return_exceptions=True)
        if registration:
            await registration.stop()
        await server.stop()
        if ucx is not None:
            await ucx.stop()
        await maintenance.stop()
        if metrics_http:
            metrics_http.close()
        for tier in store.tiers:
            tier.segment.close()


async def _first(keeping, signalled) -> None:
    """Run `keeping` until it ends or `signalled` does (then `keeping` is cancelled)."""
    tasks = [asyncio.ensure_future(keeping), asyncio.ensure_future(signalled)]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    if not tasks[0].done():
        log.warning("stopping at once: a second signal came before everything this node held was kept")
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _tenants_changed(server, shares) -> None:
    """A tenant's record changed: end the TCP connections whose token lapsed (on every transport their requests
    are refused from then on: storenode/serving/ops.py NodeOps.refusal), take its new limits."""
    ended = server.end_lapsed_tenants()
    if ended:
        log.info("closed %d connections of rotated or deleted tenant tokens", ended)
    shares.changed()


async def _until_stopped(work, stopping: asyncio.Event) -> bool:
    """Run `work` unless a stop is requested first; True if it completed."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return False
    task.result()
    return True
