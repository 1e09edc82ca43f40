"""`python -m kvpool.master`: run the control plane until SIGTERM/SIGINT."""

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

import aetcd
import grpc
from kvpool.proto import kvpool_pb2_grpc

from kvpool.security import auth, tls
from kvpool.protocol import cluster_layout
from kvpool.runtime import config
from kvpool.cluster.etcd_client import EtcdClient
from kvpool.security.grpc_auth import ServerAuth
from kvpool.runtime.process import run_server
from kvpool.protocol.units import parse_size

from . import takeover
from .adoption import Adopter
from .control_port import FRAME_TIMEOUT, ControlPort
from .election import Election
from .health_service import MasterHealth
from .eviction_watch import EvictionWatch
from .key_feed import DEFAULT_SIZE as KEY_FEED_SIZE
from .key_feed import KeyFeed
from .key_watch import KeyWatch
from .membership import Membership
from .metrics import MasterMetrics
from .node_io import NodeIO
from .node_reports import ReportPoller
from .objects import ObjectTable
from .puts import MAX_REPLICAS
from .repair import DEFAULT_RATE, Repairer
from .service import MAX_BATCH, MasterService

log = logging.getLogger("kvpool.master")

RECLAIM_INTERVAL = 0.5
ETCD_CONNECT_TIMEOUT = 10.0
STARTUP_INVENTORY_TIMEOUT = 10.0  # how long serving waits for the nodes' inventories at start
MAX_MESSAGE_BYTES = 64 << 20  # batch requests for thousands of keys exceed gRPC's 4 MiB default


def size(text: str) -> int:
    return parse_size(text)  # named `size` so argparse reports "invalid size value"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool master", description="Run the kvpool master (control plane).")
    config.add_config_option(p)
    p.add_argument("--etcd", required=True, metavar="HOST:PORT", help="etcd endpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to serve gRPC on (default 127.0.0.1)")
    p.add_argument("--advertise-host", default=None,
                   help="address clients use to reach this master (default: --host); needed with --host 0.0.0.0")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (default 0)")
    p.add_argument("--control-port", type=int, default=0,
                   help="binary control port (the same RPCs, cheaper; master/control_port.py) on --host; "
                        "0 picks a free one (default 0)")
    p.add_argument("--control-frame-timeout", type=float, default=FRAME_TIMEOUT, metavar="SECONDS",
                   help="close a control port connection whose frame stalls half-received this long "
                        f"(default {FRAME_TIMEOUT:g})")
    p.add_argument("--cluster", default=cluster_layout.DEFAULT_CLUSTER, help="cluster name (default 'default')")
    p.add_argument("--put-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="reclaim a put not ended within this many seconds (default 30)")
    p.add_argument("--max-object-size", type=size, default=None, metavar="SIZE",
                   help="largest accepted value, e.g. 64MiB (never more than the largest tier of any node, "
                        "which is the default)")
    p.add_argument("--report-interval", type=float, default=0.5, metavar="SECONDS",
                   help="ask every storage node for its usage and evictions this often (default 0.5)")
    p.add_argument("--max-hold", type=float, default=300.0, metavar="SECONDS",
                   help="longest hold an Exists may ask for; longer ones are cut to this (default 300)")
    p.add_argument("--max-batch", type=int, default=MAX_BATCH, metavar="N",
                   help=f"keys one batch call may name; larger batches are refused whole (default {MAX_BATCH})")
    p.add_argument("--max-replicas", type=int, default=MAX_REPLICAS, metavar="N",
                   help=f"copies one put may ask for (default {MAX_REPLICAS})")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port; 0 disables (default 0)")
    p.add_argument("--master-id", default=None, help="name of this master (default: host-pid)")
    p.add_argument("--repair-rate", type=size, default=DEFAULT_RATE, metavar="SIZE",
                   help="bytes per second of replica repair copies, e.g. 64MiB (default 256MiB)")
    p.add_argument("--election-ttl", type=float, default=5.0, metavar="SECONDS",
                   help="a leader that stops refreshing its etcd lease is replaced after this long (default 5; "
                        "etcd grants at least 2)")
    p.add_argument("--key-feed-size", type=int, default=KEY_FEED_SIZE, metavar="N",
                   help="changes of committed keys the leader keeps for WatchKeys subscribers to resume from; "
                        f"one further behind gets a snapshot (default {KEY_FEED_SIZE})")
    auth.add_token_argument(p)
    tls.add_tls_argument(p)
    return p


async def _reclaim_loop(table: ObjectTable, node_io: NodeIO) -> None:
    while True:
        await asyncio.sleep(RECLAIM_INTERVAL)
        keys = table.reclaim_expired()
        if keys:
            log.info("reclaimed %d puts not ended within %gs", len(keys), table.put_timeout)
        expired = table.drop_expired()
        if expired:
            log.info("dropped %d objects past their ttl", len(expired))
        node_io.submit_frees(table.take_frees())


class Leader:
    """What only the leading master runs, started by take_over(): the node watch, the
    table rebuilt from the nodes, and the background loops."""

    def __init__(self, args, etcd: aetcd.Client, election: Election, table: ObjectTable, node_io: NodeIO,
                 adopter: Adopter):
        self._args, self._etcd, self._election = args, etcd, election
        self._table, self._node_io, self._adopter = table, node_io, adopter
        self.tasks: list[asyncio.Task] = []
        self._joins: list | None = []  # node instances met before the table was rebuilt

    def _node_joined(self, node_id: str, instance: str, address: str) -> None:
        if self._joins is not None:
            self._joins.append((node_id, instance, address))
        else:
            self._adopter.node_joined(node_id, instance, address)

    async def take_over(self) -> None:
        """Know the nodes, then rebuild the table from what they hold (nothing per object is in etcd)."""
        args, loop = self._args, asyncio.get_running_loop()
        self._node_io.term = self._election.term  # REPORT and INVENTORY carry it: nodes refuse older leaders
        membership = Membership(self._etcd, args.cluster, self._table, self._node_io, on_join=self._node_joined)
        self.tasks.append(loop.create_task(membership.run(), name="membership"))
        await asyncio.wait_for(membership.synced.wait(), ETCD_CONNECT_TIMEOUT)
        joins, self._joins = self._joins, None
        # Every node at once; later joins (and nodes that did not answer now) go to the adopter.
        silent = await asyncio.wait_for(
            takeover.rebuild(self._table, self._node_io, joins, STARTUP_INVENTORY_TIMEOUT),
            STARTUP_INVENTORY_TIMEOUT * 2)
        for node in silent:
            self._adopter.node_joined(*node)
        self.tasks.append(loop.create_task(_reclaim_loop(self._table, self._node_io), name="reclaim"))
        self.tasks.append(loop.create_task(ReportPoller(self._table, self._node_io, args.report_interval).run(),
                                           name="node-reports"))
        self.tasks.append(loop.create_task(EvictionWatch(self._table, self._node_io).run(),
                                           name="eviction-watch"))
        self.tasks.append(loop.create_task(Repairer(self._table, self._node_io, args.repair_rate).run(),
                                           name="repair"))
        log.info("took over with term %d: %d objects on %d nodes (%d did not answer yet)", self._election.term,
                 self._table.object_count, len(self._table.nodes), len(silent))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _first_of(*events: asyncio.Event) -> None:
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


async def serve(args) -> int:
    etcd_host, etcd_port = cluster_layout.parse_hostport(args.etcd)
    master_id = args.master_id or f"{socket.gethostname()}-{os.getpid()}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread: the caller stops us
            loop.add_signal_handler(sig, stop.set)

    table = ObjectTable(put_timeout=args.put_timeout, max_object_size=args.max_object_size,
                        max_replicas=args.max_replicas)
    verifier = auth.Verifier(args.secret)
    auth.warn_if_open(verifier, "this master")
    node_io = NodeIO(credential=auth.Credential.for_member(args.secret) if args.secret else None,
                     tls=args.tls.client_context() if args.tls else None)
    adopter = Adopter(table, node_io)
    metrics = MasterMetrics(table)
    async with EtcdClient(etcd_host, etcd_port, node_io.credential, tls=args.tls) as etcd:
        try:
            await asyncio.wait_for(etcd.status(), ETCD_CONNECT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001
            print(f"kvpool-master: cannot reach etcd at {args.etcd}: {exc or type(exc).__name__}", file=sys.stderr)
            return 1

        server = grpc.aio.server(interceptors=[ServerAuth(verifier, metrics.refused_call)], options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                          ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        try:
            if args.tls:
                port = server.add_secure_port(f"{args.host}:{args.port}", args.tls.grpc_server_credentials())
            else:
                port = server.add_insecure_port(f"{args.host}:{args.port}")
        except RuntimeError as exc:
            log.error("binding %s:%s failed: %s", args.host, args.port, exc)
            port = 0
        if not port:
            print(f"kvpool-master: cannot listen on {args.host}:{args.port}", file=sys.stderr)
            return 1
        address = f"{args.advertise_host or args.host}:{port}"
        service = MasterService(table, node_io, metrics, master_id, address, max_hold=args.max_hold,
                                max_batch=args.max_batch)
        control = ControlPort(service, metrics.registry, args.control_frame_timeout, verifier=verifier)
        try:
            control_port = await control.bind(args.host, args.control_port,
                                              args.tls.server_context() if args.tls else None)
        except OSError as exc:
            print(f"kvpool-master: cannot listen on {args.host}:{args.control_port}: {exc}", file=sys.stderr)
            return 1
        service.control_address = f"{args.advertise_host or args.host}:{control_port}"
        election = Election(etcd, args.cluster, master_id, address, args.election_ttl, service.control_address)
        election.serving = False  # leads and has taken over: the service answers only then
        service.leadership = election
        feed = KeyFeed(table, args.key_feed_size)  # open while this master leads (key_feed.py)
        service.key_watch = KeyWatch(feed)
        kvpool_pb2_grpc.add_MasterServicer_to_server(service, server)
        health = MasterHealth(server, election, metrics)
        health_task = loop.create_task(health.run(), name="health")
        leader: Leader | None = None
        campaign: asyncio.Task | None = None
        feed_task = loop.create_task(feed.run(election), name="key-feed")
        try:
            node_io.start()
            await election.start()
            await server.start()  # followers serve too: Stats, and NOT_LEADER naming the leader
            await control.start()
            if args.metrics_port:
                metrics.serve(args.metrics_port, args.host, health.probes)
            # A lone master leads before it says it is ready, so its first client is served at once.
            if await election.campaign(give_up_after=0):
                leader = Leader(args, etcd, election, table, node_io, adopter)
                await _lead(leader, election)
            else:
                log.info("master %s following %s", master_id, election.leader_address or "(none yet)")
            health.joined = True
            print(f"kvpool-master ready address={address} control={service.control_address}", flush=True)
            log.info("master %s serving cluster %r on %s", master_id, args.cluster, address)
            while not stop.is_set():
                if leader is None:
                    campaign = loop.create_task(election.campaign(), name="campaign")
                    stopping = loop.create_task(stop.wait(), name="stop-wait")
                    await asyncio.wait([campaign, stopping], return_when=asyncio.FIRST_COMPLETED)
                    stopping.cancel()
                    if not campaign.done():
                        break  # stopped while following
                    campaign.result()
                    campaign = None
                    leader = Leader(args, etcd, election, table, node_io, adopter)
                    try:
                        await _lead(leader, election)
                    except Exception as exc:  # noqa: BLE001 - etcd or the nodes failed the takeover: try again
                        log.error("taking over failed (%s: %s)", type(exc).__name__, exc)
                        election.step_down()
                if election.is_leader:
                    await _first_of(stop, election.lost)
                if stop.is_set():
                    break
                # Deposed: stop the term's work, forget its (possibly stale) table, campaign afresh.
                election.step_down()
                await _step_down(leader, election, table, node_io, adopter)
                leader = None
                campaign = loop.create_task(election.rejoin(), name="rejoin")
                stopping = loop.create_task(stop.wait(), name="stop-wait")
                await asyncio.wait([campaign, stopping], return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                if not campaign.done():
                    break
                campaign.result()
                campaign = None
            log.info("stopping")
        finally:
            health.stopping = True
            election.serving = False
            for task in (feed_task, health_task):
                task.cancel()
            await asyncio.gather(feed_task, health_task, return_exceptions=True)
            if campaign is not None:
                campaign.cancel()
                await asyncio.gather(campaign, return_exceptions=True)
            await election.resign()
            await server.stop(grace=1.0)
            await control.stop()
            if leader is not None:
                await leader.stop()
            await adopter.close()
            await node_io.close()
            metrics.stop()
    return 0


async def _lead(leader: Leader, election: Election) -> None:
    await leader.take_over()
    election.serving = election.is_leader  # the lease may have expired while taking over


async def _step_down(leader: Leader, election: Election, table: ObjectTable, node_io: NodeIO,
                     adopter: Adopter) -> None:
    """End a lost term: nothing it started may act for the next one."""
    election.serving = False  # from now on every RPC but Stats answers NOT_LEADER
    log.error("leadership of term %d lost; following until this master wins again", election.term)
    await leader.stop()
    await adopter.close()
    node_io.discard_frees()
    table.reset()


def main(argv=None) -> int:
    parser = build_parser()
    args, _ = config.resolve(parser, "master", argv)
    args.secret = auth.secret_of(parser, args)
    args.tls = tls.files_of(parser, args)
    for flag in ("put_timeout", "report_interval", "max_hold", "repair_rate", "election_ttl", "key_feed_size",
                 "control_frame_timeout", "max_batch", "max_replicas"):
        if not getattr(args, flag) > 0:  # also NaN
            print(f"kvpool-master: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    try:
        cluster_layout.parse_hostport(args.etcd)
    except ValueError as exc:
        print(f"kvpool-master: --etcd: {exc}", file=sys.stderr)
        return 2
    return run_server(serve(args), fast_loop=True)  # no sendfile here: uvloop serves the control port
