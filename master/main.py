"""`python -m kvpool.master`: run the control plane until SIGTERM/SIGINT."""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys

import aetcd
import grpc

from kvpool import cluster_layout
from kvpool.proto import kvpool_pb2_grpc
from kvpool.process import run_server
from kvpool.units import parse_size

from .adoption import Adopter
from .membership import Membership
from .metrics import MasterMetrics
from .node_io import NodeIO
from .node_reports import ReportPoller
from .objects import ObjectTable
from .service import MasterService

log = logging.getLogger("kvpool.master")

LEASE_TTL = 5  # seconds the master's etcd record outlives a master that died without revoking it
RECLAIM_INTERVAL = 0.5
ETCD_CONNECT_TIMEOUT = 10.0
STARTUP_INVENTORY_TIMEOUT = 10.0  # how long serving waits for the nodes' inventories at start
MAX_MESSAGE_BYTES = 64 << 20  # batch requests for thousands of keys exceed gRPC's 4 MiB default


def size(text: str) -> int:
    return parse_size(text)  # named `size` so argparse reports "invalid size value"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool master", description="Run the kvpool master (control plane).")
    p.add_argument("--etcd", required=True, metavar="HOST:PORT", help="etcd endpoint")
    p.add_argument("--host", default="127.0.0.1", help="address to serve gRPC on (default 127.0.0.1)")
    p.add_argument("--advertise-host", default=None,
                   help="address clients use to reach this master (default: --host); needed with --host 0.0.0.0")
    p.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (default 0)")
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
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus metrics on this port; 0 disables (default 0)")
    p.add_argument("--master-id", default=None, help="name of this master (default: host-pid)")
    return p


class Registration:
    """The master's record in etcd, under a lease refreshed every ttl/3 and re-created if lost."""

    def __init__(self, etcd: aetcd.Client, key: bytes, value: bytes, ttl: int = LEASE_TTL):
        self._etcd, self._key, self._value, self._ttl = etcd, key, value, ttl
        self._lease = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self._register()
        self._task = asyncio.get_running_loop().create_task(self._keep_alive(), name="master-lease")

    async def _register(self) -> None:
        self._lease = await self._etcd.lease(self._ttl)
        await self._etcd.put(self._key, self._value, lease=self._lease)

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self._ttl / 3)
            try:
                reply = await self._etcd.refresh_lease(self._lease.id)
                if reply is None or reply.TTL <= 0:  # expired while etcd was unreachable
                    log.warning("master lease was lost; registering again")
                    await self._register()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - keep trying while etcd is away
                log.warning("refreshing the master lease failed: %s", exc)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._etcd.revoke_lease(self._lease.id), 3)


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


async def serve(args) -> int:
    etcd_host, etcd_port = cluster_layout.parse_hostport(args.etcd)
    master_id = args.master_id or f"{socket.gethostname()}-{os.getpid()}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread: the caller stops us
            loop.add_signal_handler(sig, stop.set)

    table = ObjectTable(put_timeout=args.put_timeout, max_object_size=args.max_object_size)
    node_io = NodeIO()
    adopter = Adopter(table, node_io)
    metrics = MasterMetrics(table)
    tasks: list[asyncio.Task] = []
    async with aetcd.Client(host=etcd_host, port=etcd_port) as etcd:
        try:
            await asyncio.wait_for(etcd.status(), ETCD_CONNECT_TIMEOUT)
        except Exception as exc:  # noqa: BLE001
            print(f"kvpool-master: cannot reach etcd at {args.etcd}: {exc or type(exc).__name__}", file=sys.stderr)
            return 1

        server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                          ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
        try:
            port = server.add_insecure_port(f"{args.host}:{args.port}")
        except RuntimeError as exc:
            log.error("binding %s:%s failed: %s", args.host, args.port, exc)
            port = 0
        if not port:
            print(f"kvpool-master: cannot listen on {args.host}:{args.port}", file=sys.stderr)
            return 1
        address = f"{args.advertise_host or args.host}:{port}"
        kvpool_pb2_grpc.add_MasterServicer_to_server(MasterService(table, node_io, metrics, master_id, address,
                                                                   max_hold=args.max_hold),
                                                     server)
        registration = Registration(etcd, cluster_layout.master_key(args.cluster),
                                    json.dumps({"address": address, "master_id": master_id}).encode())
        try:
            node_io.start()
            membership = Membership(etcd, args.cluster, table, node_io, on_join=adopter.node_joined)
            tasks.append(loop.create_task(membership.run(), name="membership"))
            # Know the nodes before serving, so the first put does not see an empty cluster.
            try:
                await asyncio.wait_for(membership.synced.wait(), ETCD_CONNECT_TIMEOUT)
            except TimeoutError:
                print(f"kvpool-master: cannot read the node set from etcd at {args.etcd}", file=sys.stderr)
                return 1
            # ...and what they hold, so a restarted master serves the objects that survived it.
            try:
                await asyncio.wait_for(adopter.idle(), STARTUP_INVENTORY_TIMEOUT)
            except TimeoutError:
                log.warning("serving before every node's inventory arrived; the rest is adopted as it comes")
            await server.start()
            await registration.start()
            tasks.append(loop.create_task(_reclaim_loop(table, node_io), name="reclaim"))
            tasks.append(loop.create_task(ReportPoller(table, node_io, args.report_interval).run(),
                                          name="node-reports"))
            if args.metrics_port:
                metrics.serve(args.metrics_port, args.host)
            print(f"kvpool-master ready address={address}", flush=True)
            log.info("master %s serving cluster %r on %s", master_id, args.cluster, address)
            await stop.wait()
            log.info("stopping")
        finally:
            await registration.stop()
            await server.stop(grace=1.0)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await adopter.close()
            await node_io.close()
            metrics.stop()
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("put_timeout", "report_interval", "max_hold"):
        if not getattr(args, flag) > 0:  # also NaN
            print(f"kvpool-master: --{flag.replace('_', '-')} must be positive", file=sys.stderr)
            return 2
    try:
        cluster_layout.parse_hostport(args.etcd)
    except ValueError as exc:
        print(f"kvpool-master: --etcd: {exc}", file=sys.stderr)
        return 2
    return run_server(serve(args))
