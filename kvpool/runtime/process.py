"""What every kvpool server process does around its asyncio main: logging to stderr, Ctrl-C as a clean exit."""

import asyncio
import errno
import gc
import logging
import os
import resource
import socket
import sys

from ..protocol import release, wire
from . import gc_pauses

# KVPOOL_EVENT_LOOP=asyncio runs a server that asks for uvloop on the standard loop instead.
EVENT_LOOP_ENV = "KVPOOL_EVENT_LOOP"


def _loop_factory(fast: bool):
    """uvloop's loop when `fast` and it is installed: it serves a small request several times cheaper
    than the standard loop (measured on the master's control port). Such servers must not use
    loop.sock_sendfile, which uvloop lacks (kvpool/sockets/socket_output.py works on both)."""
    if not fast or os.environ.get(EVENT_LOOP_ENV, "").strip().lower() == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


# Descriptors kept out of every connection cap: etcd and gRPC channels, the member's connections to nodes,
# segment and log files, the metrics server, the loop's own (epoll, self-pipe), the executor's files.
DESCRIPTOR_RESERVE = 256
MIN_CONNECTIONS = 64  # fewer than this fitting under the descriptor limit refuses to start (fit_caps)


def descriptor_budget(reserve: int = DESCRIPTOR_RESERVE) -> int:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit (a server's connections are its
    descriptors, and the soft default is often 1024), and return how many its connection caps may
    share: the limit less `reserve`. Past the limit accept() fails with no answer to the peer, so the
    caps added up must stay below it; each server's main fits its caps into this (fit_caps)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # e.g. a hard limit of RLIM_INFINITY the kernel will not take
            pass
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(1, soft - reserve)


def fit_caps(caps: dict[str, int], shrink: str, budget: int) -> dict[str, int]:
    """The connection caps `caps` (flag name -> value), with caps[shrink] lowered so that they add up to at most
    `budget` descriptors; the others are small and kept as given. ValueError, one line naming the cause and the
    fix, when that leaves caps[shrink] fewer than MIN_CONNECTIONS (and fewer than asked): such a server would
    serve a handful of peers at a time and turn the rest away."""
    others = sum(value for name, value in caps.items() if name != shrink)
    fitted = dict(caps)
    fitted[shrink] = max(1, min(caps[shrink], budget - others))
    if fitted[shrink] < min(MIN_CONNECTIONS, caps[shrink]):
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        raise ValueError(f"the open-file limit ({limit}) leaves room for {max(0, budget - others)} of the "
                         f"{caps[shrink]} connections {shrink} asks ({DESCRIPTOR_RESERVE} descriptors are kept for "
                         f"files and the rest for {', '.join(name for name in caps if name != shrink)}): raise it "
                         f"(ulimit -n 65536; systemd LimitNOFILE=; docker --ulimit nofile=65536) or give "
                         f"{shrink} {MIN_CONNECTIONS} or fewer")
    if fitted[shrink] < caps[shrink]:
        logging.getLogger(__name__).warning("%s lowered from %d to %d to fit the descriptor limit (%d usable)",
                                            shrink, caps[shrink], fitted[shrink], budget)
    return fitted


def memory_limit() -> tuple[int, str]:
    """(bytes, what sets them) of the memory this process may use: the machine's, or its cgroup's (a container's
    memory limit) when lower."""
    limit, source = 0, "this machine has"
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                limit = int(line.split()[1]) * 1024
                break
    try:
        with open("/sys/fs/cgroup/memory.max") as cgroup:  # cgroup v2; "max": none
            value = cgroup.read().strip()
        if value.isdigit() and 0 < int(value) < limit:
            limit, source = int(value), "this container's memory limit (cgroup memory.max) allows"
    except OSError:
        pass
    return limit, source


def version_line(program: str) -> str:
    """What `--version` prints and a server logs as it starts: the release and the wire protocol it speaks."""
    return f"{program} {release.VERSION} (wire protocol {wire.VERSION})"


def register_build_info(registry) -> None:
    """kvpool_build_info{version, wire_protocol} 1 in a server's metrics (which release each process runs)."""
    from prometheus_client import Info

    Info("kvpool_build", "The kvpool release this process runs and the wire protocol it speaks",
         registry=registry).info({"version": release.VERSION, "wire_protocol": str(wire.VERSION)})


def run_server(main_coro, fast_loop: bool = False) -> int:
    """Run `main_coro` (returning an exit code) with the common logging setup; on uvloop if
    `fast_loop` (see _loop_factory)."""
    # A server keeps millions of long-lived records (the master's table, a node's index) and frees
    # almost everything by reference count: collect the young generation 20x less often, and consider a
    # full collection after every middle one, each walking only what came since the last freeze
    # (gc_pauses.py: at 3,000,000 records the longest pause 0.12 s against 1.15 s at (14_000, 10, 10)).
    gc.set_threshold(14_000, 10, 1)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with asyncio.Runner(loop_factory=_loop_factory(fast_loop)) as runner:
            gc_pauses.install(runner.get_loop())
            return runner.run(main_coro)
    except KeyboardInterrupt:
        return 0


# -- the last line of a server that cannot start: what failed, why, and what to do about it


def cannot_listen(program: str, host: str, port: int, flag: str, exc: BaseException | None = None) -> str:
    """A server could not listen on host:port; `flag` chooses the port. The reason is the OS's (from
    `exc`, else asked again with a plain bind: gRPC does not say why)."""
    code = exc.errno if isinstance(exc, OSError) and exc.errno else _bind_errno(host, port)
    reason = os.strerror(code) if code else "refused"
    if code == errno.EADDRINUSE:
        fix = f"stop what listens there, or pass another {flag} (0: any free one)"
    elif code == errno.EADDRNOTAVAIL:
        fix = "pass a --host this machine has (0.0.0.0: all of them)"
    else:
        fix = f"check --host and {flag}"
    return f"{program}: cannot listen on {host}:{port}: {reason}: {fix}"


def _bind_errno(host: str, port: int) -> int:
    """Why binding host:port fails now, as an errno (0: it does not, or it cannot be told)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no clash
            probe.bind((host, port))
    except OSError as exc:
        return exc.errno or 0
    return 0


def cannot_reach_etcd(program: str, endpoint: str, exc: BaseException) -> str:
    """A server could not reach (or register in) etcd at `endpoint` before its deadline."""
    return (f"{program}: cannot reach etcd at {endpoint}: {str(exc).strip() or type(exc).__name__}: "
            f"start etcd there, or pass --etcd HOST:PORT of a running one")
