"""`python -m kvpool.storenode`: run one storage node until SIGTERM/SIGINT."""

import argparse
import asyncio
import logging
import os
import re
import secrets
import signal
import uuid

from prometheus_client import start_http_server

from kvpool.cluster_layout import DEFAULT_CLUSTER, NodeRecord, TierRecord, parse_hostport
from kvpool.errors import KvpoolError
from kvpool.process import run_server
from kvpool.units import parse_size

from .dram import DramSegment, segment_name
from .extents import ExtentTable
from .metrics import NodeMetrics
from .registration import NodeRegistration
from .server import DataServer

log = logging.getLogger("kvpool.storenode")

# Node ids and cluster names become etcd key segments and /dev/shm file names.
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvpool storenode", description="Run a kvpool storage node.")
    p.add_argument("--etcd", required=True, type=_hostport, metavar="HOST:PORT", help="etcd client endpoint")
    p.add_argument("--dram", required=True, type=_positive_size, metavar="SIZE",
                   help="DRAM segment size, e.g. 1GiB")
    p.add_argument("--host", default="127.0.0.1", help="address to serve on")
    p.add_argument("--advertise-host", default=None,
                   help="address clients use to reach this node (default: --host); needed with --host 0.0.0.0")
    p.add_argument("--port", type=int, default=0, help="data port (0: any free port)")
    p.add_argument("--cluster", type=_name, default=DEFAULT_CLUSTER)
    p.add_argument("--node-id", type=_name, default=None, help="default: node-<random hex>")
    p.add_argument("--data-dir", default=None, help="node-local files (reserved for an SSD tier)")
    p.add_argument("--lease-ttl", type=float, default=5.0, metavar="SECONDS",
                   help="etcd lease TTL; the master drops the node this long after it dies")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus HTTP port (0: none)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_server(_serve(args))


async def _serve(args) -> int:
    node_id = args.node_id or f"node-{secrets.token_hex(4)}"
    instance = uuid.uuid4().hex
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)

    try:
        segment = DramSegment(args.dram, segment_name(args.cluster, node_id, instance))
    except (OSError, ValueError) as exc:
        log.error("cannot allocate the DRAM segment of %d bytes: %s", args.dram, exc)
        return 1
    table = ExtentTable()
    metrics = NodeMetrics()
    metrics.track_table(table, segment.capacity)
    server = DataServer(segment, table, node_id, metrics)
    metrics_http = None
    registration = None
    try:
        _, port = await server.start(args.host, args.port)
        if args.metrics_port:
            metrics_http, _ = start_http_server(args.metrics_port, addr=args.host, registry=metrics.registry)
        record = NodeRecord(node_id=node_id, instance=instance, host=args.advertise_host or args.host,
                            data_port=port,
                            tiers={"dram": TierRecord(segment.capacity, segment.path)},
                            metrics_port=args.metrics_port, pid=os.getpid())
        registration = NodeRegistration(args.etcd, args.cluster, record, args.lease_ttl)
        if not await _until_stopped(registration.start(), stopping):
            return 0
        print(f"kvpool-storenode ready node_id={node_id} address={record.address}", flush=True)
        await stopping.wait()
        log.info("stopping")
        return 0
    except (OSError, KvpoolError) as exc:
        log.error("storage node failed: %s", exc)
        return 1
    finally:
        if registration:
            await registration.stop()
        await server.stop()
        if metrics_http:
            metrics_http.shutdown()
        segment.close()


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
