"""`python -m kvpool.master`: run the control plane until SIGTERM/SIGINT.

Start-up: the options, the parts of the master, its servers (gRPC, the control
port, metrics) and their orderly stop. What happens as this master wins and
loses the leadership is leadership/lifecycle.py.
"""

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys

import grpc
from kvpool.proto import kvpool_pb2_grpc

from kvpool.security import auth, placement_seal, tls
from kvpool.protocol import cluster_layout
from kvpool.runtime import config
from kvpool.cluster.etcd_client import EtcdClient, OpenEtcdError, add_open_etcd_argument
from kvpool.cluster.tenant_directory import TenantDirectory, TenantRecords
from kvpool.security.grpc_auth import ServerAuth
from kvpool.security.replay_cache import CAPACITY as REMEMBERED_PROOFS
from kvpool.security.replay_cache import ReplayCache
from kvpool.runtime.health import HTTP_CONNECTIONS
from kvpool.runtime.process import (cannot_listen, cannot_reach_etcd, descriptor_budget, fit_caps, run_server,
                                    version_line)
from kvpool.sockets.admission import UNPROVED, UNPROVED_PER_ADDRESS
from kvpool.protocol.units import parse_size

from kvpool.master.leadership.adoption import Adopter
from kvpool.master.serving.control_port import FRAME_TIMEOUT, MAX_CONNECTIONS, ControlPort
from kvpool.master.leadership.election import Election
from kvpool.master.serving.health_service import MasterHealth
from kvpool.master.serving.key_feed import DEFAULT_SIZE as KEY_FEED_SIZE
from kvpool.master.serving.key_feed import KeyFeed
from kvpool.master.serving.key_watch import KeyWatch
from kvpool.master.leadership.inventory_mirror import MIRROR_INTERVAL
from kvpool.master.leadership.lease_refresh import GatewayLease
from kvpool.master.leadership.lifecycle import ETCD_CONNECT_TIMEOUT, Leadership
from kvpool.master.serving.metrics import MasterMetrics
from kvpool.master.nodes.node_io import NodeIO
from kvpool.master.table.objects import ObjectTable
from kvpool.master.table.pending_puts import MAX_REPLICAS
from kvpool.master.nodes.repair import DEFAULT_RATE
from kvpool.master.serving.service import MAX_BATCH, MasterService
from kvpool.master.serving.tenants import TenantAdmin

log = logging.getLogger("kvpool.master")

MAX_MESSAGE_BYTES = 64 << 20  # batch requests for thousands of keys exceed gRPC's 4 MiB default
GRPC_MAX_CONNECTIONS = 1024  # default --grpc-max-connections (clients call over the control port mostly)
GRPC_HANDSHAKE_TIMEOUT = 10.0  # default --grpc-handshake-timeout
GRPC_IDLE_TIMEOUT = 60.0  # default --grpc-idle-timeout: clients reconnect on their next call, unnoticed
GRPC_MAX_STREAMS = 1024  # calls at once on one gRPC connection; a client's further calls queue on its side


def size(text: str) -> int:
    return parse_size(text)  # named `size` so argparse reports "invalid size value"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool master", description="Run the kvpool master (control plane).")
    p.add_argument("--version", action="version", version=version_line("kvpool-master"))
    config.add_config_option(p)
    p.add_argument("--etcd", required=True, metavar="HOST:PORT", help="etcd endpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to serve gRPC on (default 127.0.0.1)")
    p.add_argument("--advertise-host", default=None,
                   help="address clients use to reach this master (default: --host); needed with --host 0.0.0.0")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (default 0)")
    p.add_argument("--control-port", type=int, default=0,
                   help="binary control port (the same RPCs, cheaper; master/serving/control_port.py) on --host; "
                        "0 picks a free one (default 0)")
    p.add_argument("--control-frame-timeout", type=float, default=FRAME_TIMEOUT, metavar="SECONDS",
                   help="close a control port connection whose frame stalls half-received this long "
                        f"(default {FRAME_TIMEOUT:g})")
    p.add_argument("--control-max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                   help="control port connections that proved their credential at once; more are answered "
                        f"UNAVAILABLE and closed (default {MAX_CONNECTIONS}, lowered to fit the descriptor limit)")
    p.add_argument("--control-max-unproved", type=int, default=UNPROVED, metavar="N",
                   help="control port connections still in their handshake at once, apart from "
                        f"--control-max-connections; a new one past it displaces the oldest (default {UNPROVED})")
    p.add_argument("--control-max-unproved-per-address", type=int, default=UNPROVED_PER_ADDRESS, metavar="N",
                   help=f"of --control-max-unproved, from one peer address (default {UNPROVED_PER_ADDRESS})")
    p.add_argument("--grpc-max-connections", type=int, default=GRPC_MAX_CONNECTIONS, metavar="N",
                   help=f"gRPC connections at once; more are closed on accept (default {GRPC_MAX_CONNECTIONS})")
    p.add_argument("--grpc-handshake-timeout", type=float, default=GRPC_HANDSHAKE_TIMEOUT, metavar="SECONDS",
                   help="close a gRPC connection that has not completed its TLS and HTTP/2 handshake this long "
                        f"after connecting (default {GRPC_HANDSHAKE_TIMEOUT:g})")
    p.add_argument("--grpc-idle-timeout", type=float, default=GRPC_IDLE_TIMEOUT, metavar="SECONDS",
                   help="close a gRPC connection with no call for this long; its client reconnects on its next "
                        f"call (default {GRPC_IDLE_TIMEOUT:g})")
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
    p.add_argument("--standby-copy-interval", type=float, default=MIRROR_INTERVAL, metavar="SECONDS",
                   help="a standby reads what changed in every node's inventory this often, so its takeover reads "
                        f"only what changed since; 0 reads every inventory whole at takeover (default {MIRROR_INTERVAL:g})")
    p.add_argument("--key-feed-size", type=int, default=KEY_FEED_SIZE, metavar="N",
                   help="changes of committed keys the leader keeps for WatchKeys subscribers to resume from; "
                        f"one further behind gets a snapshot (default {KEY_FEED_SIZE})")
    p.add_argument("--remembered-proofs", type=int, default=REMEMBERED_PROOFS, metavar="N",
                   help="gRPC call proofs remembered to refuse replays; when full the oldest is forgotten and "
                        f"proofs no newer than it refused (default {REMEMBERED_PROOFS})")
    auth.add_token_argument(p)
    add_open_etcd_argument(p)
    tls.add_tls_argument(p)
    return p


async def serve(args) -> int:
    etcd_host, etcd_port = cluster_layout.parse_hostport(args.etcd)
    master_id = args.master_id or f"{socket.gethostname()}-{os.getpid()}"
    log.info("%s, master %s", version_line("kvpool-master"), master_id)
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
    async with EtcdClient(etcd_host, etcd_port, node_io.credential, tls=args.tls,
                          allow_open=args.allow_etcd_without_auth) as etcd:
        try:
            await asyncio.wait_for(etcd.status(), ETCD_CONNECT_TIMEOUT)
        except OpenEtcdError as exc:
            print(f"kvpool-master: {exc}", file=sys.stderr, flush=True)
            return 1
        except Exception as exc:  # noqa: BLE001
            print(cannot_reach_etcd("kvpool-master", args.etcd, exc), file=sys.stderr, flush=True)
            return 1

        # No SO_REUSEPORT: gRPC sets it by default, and a port another server holds (an earlier master's) would
        # then be shared with it, its connections dealt out between the two, instead of refused.
        server_auth = ServerAuth(verifier, metrics.refused_call, ReplayCache(args.remembered_proofs))
        server = grpc.aio.server(interceptors=[server_auth],
                                 options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                          ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                          ("grpc.so_reuseport", 0), *grpc_bounds(args)])
        try:
            if args.tls:
                port = server.add_secure_port(f"{args.host}:{args.port}", args.tls.grpc_server_credentials())
            else:
                port = server.add_insecure_port(f"{args.host}:{args.port}")
        except RuntimeError as exc:
            log.error("binding %s:%s failed: %s", args.host, args.port, exc)
            port = 0
        if not port:
            print(cannot_listen("kvpool-master", args.host, args.port, "--port"), file=sys.stderr, flush=True)
            return 1
        address = f"{args.advertise_host or args.host}:{port}"
        server_auth.calls.master = address  # the name call proofs are made for (kvpool/security/grpc_auth.py)
        service = MasterService(table, node_io, metrics, master_id, address, max_hold=args.max_hold,
                                max_batch=args.max_batch)
        service.sealer = placement_seal.for_secret(args.secret)
        control = ControlPort(service, metrics.registry, args.control_frame_timeout, verifier=verifier,
                              max_connections=args.control_max_connections,
                              max_unproved=args.control_max_unproved,
                              max_unproved_per_address=args.control_max_unproved_per_address)
        try:
            control_port = await control.bind(args.host, args.control_port,
                                              args.tls.server_context() if args.tls else None)
        except OSError as exc:
            print(cannot_listen("kvpool-master", args.host, args.control_port, "--control-port", exc),
                  file=sys.stderr, flush=True)
            return 1
        service.control_address = f"{args.advertise_host or args.host}:{control_port}"
        lease = GatewayLease(f"{etcd_host}:{etcd_port}", args.tls.client_context() if args.tls else None)
        election = Election(etcd, args.cluster, master_id, address, args.election_ttl, service.control_address,
                            refresh=lease.refresh)
        service.leadership = election
        leadership = Leadership(args, etcd, election, table, node_io, adopter)
        feed = KeyFeed(table, args.key_feed_size)  # opened by a term's first subscriber (key_feed.py)
        service.key_watch = KeyWatch(feed)
        service.tenants = TenantAdmin(TenantRecords(etcd, args.cluster), verifier, table)
        service.current = verifier.current
        tenants = TenantDirectory(etcd, args.cluster, verifier, on_change=control.end_lapsed_tenants)
        kvpool_pb2_grpc.add_MasterServicer_to_server(service, server)
        health = MasterHealth(server, election, metrics)
        health_task = loop.create_task(health.run(), name="health")
        feed_task = loop.create_task(feed.run(election), name="key-feed")
        tenants_task = loop.create_task(tenants.run(), name="tenant-directory")
        try:
            node_io.start()
            await election.start()
            await server.start()  # followers serve too: Stats, and NOT_LEADER naming the leader
            await control.start()
            if args.metrics_port:
                await metrics.serve(args.metrics_port, args.host, health.probes)
            if not await leadership.first_campaign():
                log.info("master %s following %s", master_id, election.leader_address or "(none yet)")
            health.joined = True
            print(f"kvpool-master ready address={address} control={service.control_address}", flush=True)
            log.info("master %s serving cluster %r on %s", master_id, args.cluster, address)
            await leadership.run(stop)
            log.info("stopping")
        finally:
            health.stopping = True
            await leadership.stop_campaign()
            for task in (feed_task, health_task, tenants_task):
                task.cancel()
            await asyncio.gather(feed_task, health_task, tenants_task, return_exceptions=True)
            await election.resign()
            await server.stop(grace=1.0)
            await control.stop()
            await leadership.stop_term()
            await adopter.close()
            await node_io.close()
            metrics.stop()
    return 0


def grpc_bounds(args) -> list[tuple[str, int]]:
    """gRPC core's own bounds on the connections to the gRPC port (options named in grpc's
    channel_arg_names.h): a cap on connections, a deadline for a new one's handshakes (a TCP connection
    that never sends the HTTP/2 preface is closed after it), idle connections closed, calls per connection."""
    return [("grpc.max_allowed_incoming_connections", args.grpc_max_connections),
            ("grpc.server_handshake_timeout_ms", int(args.grpc_handshake_timeout * 1000)),
            ("grpc.max_connection_idle_ms", int(args.grpc_idle_timeout * 1000)),
            ("grpc.max_concurrent_streams", GRPC_MAX_STREAMS)]


def fit_connection_caps(args) -> None:
    """Raise the descriptor limit and fit the connection caps under it, lowering --control-max-connections
    (the others are small, or gRPC's own, which turns connections away past its cap without failing)."""
    caps = fit_caps({"--control-max-connections": args.control_max_connections,
                     "--control-max-unproved": args.control_max_unproved,
                     "--grpc-max-connections": args.grpc_max_connections, "metrics connections": HTTP_CONNECTIONS},
                    "--control-max-connections", descriptor_budget())
    args.control_max_connections = caps["--control-max-connections"]


def main(argv=None) -> int:
    parser = build_parser()
    args, _ = config.resolve(parser, "master", argv)
    args.secret = auth.secret_of(parser, args)
    args.tls = tls.files_of(parser, args)
    options = vars(args)
    for flag in ("put_timeout", "report_interval", "max_hold", "repair_rate", "election_ttl", "key_feed_size",
                 "control_frame_timeout", "max_batch", "max_replicas", "remembered_proofs",
                 "control_max_connections", "control_max_unproved", "control_max_unproved_per_address",
                 "grpc_max_connections", "grpc_handshake_timeout", "grpc_idle_timeout"):
        if not options[flag] > 0:  # also NaN
            print(f"kvpool-master: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    try:
        cluster_layout.parse_hostport(args.etcd)
    except ValueError as exc:
        print(f"kvpool-master: --etcd: {exc}", file=sys.stderr)
        return 2
    try:
        fit_connection_caps(args)
    except ValueError as exc:  # a limit of this machine's that leaves it unable to serve
        print(f"kvpool-master: {exc}", file=sys.stderr, flush=True)
        return 1
    return run_server(serve(args), fast_loop=True)  # no sendfile here: uvloop serves the control port
