"""Strangers holding ports (called by benchmarks/hostile_peers.py): peers without the secret try to keep a
node's data port, the master's control port, its gRPC port and a metrics/health port from serving anyone.

- slow AUTH: a few connections send a well-formed AUTH frame one byte a second (each byte would restart a
  per-byte timeout); the server must close each within its --frame-timeout of the accept;
- flood: many connections that never prove anything, held open, from many addresses (on loopback), the
  honest client's among them: more than the unproved pools and the proved slots.

Each case reports what was tried, how many the server closed, the longest a stranger held its connection,
how many were still open when the real client came, and the seconds until a real client was served (a fresh Client's put and get with the client token; a gRPC
call; an HTTP GET of /healthz) both WHILE the hostile connections are held and at the END of the case, once
the server closed them. Where the design serves while held: every case here (the node and control ports
displace the oldest unproved connection for a new one; gRPC holds connections under its
--grpc-max-connections cap, which this flood stays under, and closes them at --grpc-handshake-timeout;
the HTTP server displaces the oldest open connection).
"""

import os
import select
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvpool import Client
from kvpool.protocol import wire
from kvpool.proto import kvpool_pb2 as pb
from kvpool.runtime.http_endpoint import REQUEST_DEADLINE
from kvpool.proto import kvpool_pb2_grpc
from kvpool.security import auth
from kvpool.security.grpc_auth import blocking_channel

SERVED_WITHIN = 1.0  # seconds a real client may wait, while held and at the end
# A server's deadline runs from its accept, which a busy loop may make a while after our connect.
ACCEPT_SLACK = 2.0
SLOW_CONNECTIONS = 4
FLOOD = 300  # connections per flood and port: past the unproved pool (256), under gRPC's cap (1024)
SOURCES = 40  # peer addresses of a flood: under 10 connections each, below the per-address caps
# Proved slots for the run: fewer than a flood, so a flood that could take them would refuse the real client.
NODE_CAPS = ["--max-connections", "64"]
MASTER_CAPS = ["--control-max-connections", "64"]
DRIP = 1.0  # seconds between the bytes of a slow AUTH


def _hostport(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _forged_auth() -> bytes:
    return wire.REQUEST.pack(wire.MAGIC, wire.VERSION, wire.Op.AUTH, 1, 0, auth.Role.CLIENT, 0, 0,
                             auth.NONCE + auth.PROOF, 0) + os.urandom(auth.NONCE + auth.PROOF)


def _hold(socks: list, opened: list, held: list, limit: float, drip: bytes = b"") -> None:
    """Hold `socks` (opened at the monotonic times `opened`), reading and dropping what the server sends,
    and with `drip` one byte of it a DRIP on each, until the server closes each or `limit` seconds pass.
    Sets held[i] to the seconds socks[i] stayed open (None: still open)."""
    deadline = time.monotonic() + limit
    next_drip = time.monotonic()
    sent = 0
    poll = select.poll()  # not select(): a flood's descriptors go past 1024
    index = {sock.fileno(): i for i, sock in enumerate(socks)}
    for fd in index:
        poll.register(fd, select.POLLIN)
    while time.monotonic() < deadline and any(h is None for h in held):
        for fd, _event in poll.poll(50):
            i = index[fd]
            try:
                gone = not socks[i].recv(65536)
            except OSError:
                gone = True
            if gone:
                held[i] = time.monotonic() - opened[i]
                poll.unregister(fd)
        if drip and sent < len(drip) and time.monotonic() >= next_drip:
            for i, sock in enumerate(socks):
                if held[i] is None:
                    try:
                        sock.send(drip[sent:sent + 1])
                    except OSError:
                        held[i] = time.monotonic() - opened[i]
            sent += 1
            next_drip += DRIP


def _timed(serve) -> float | None:
    """Seconds `serve()` took to be served; None if it failed."""
    started = time.monotonic()
    try:
        serve()
    except Exception:  # noqa: BLE001 - a refused or failed client is the finding, reported as None
        return None
    return round(time.monotonic() - started, 3)


def _case(turn: threading.Lock, addresses: list, count: int, serve, deadline: float, drip: bytes = b"") -> dict:
    """`count` hostile connections to each of `addresses`, which must close each within `deadline` of its
    accept; a real client timed while they are held and once they are gone. Cases run at once, but each
    opens its connections and times its real client in `turn`, one case at a time: in this one process
    they would otherwise time each other."""
    with turn:
        socks, opened = [], []
        for address in addresses:
            host, port = _hostport(address)
            for i in range(count):
                # On loopback, from SOURCES addresses (127.0.0.1, the real client's, among them), as from many.
                source = (f"127.0.0.{1 + i % SOURCES}", 0) if host.startswith("127.") else None
                try:
                    socks.append(socket.create_connection((host, port), timeout=10, source_address=source))
                except OSError:  # refused at accept: counted as tried, not held
                    continue
                opened.append(time.monotonic())
                socks[-1].setblocking(False)
        count *= len(addresses)
        held = [None] * len(socks)
        holding = threading.Thread(target=_hold, args=(socks, opened, held, deadline + 5, drip), daemon=True)
        holding.start()
        time.sleep(0.1)  # the closes the server made on accept (connections displaced) are seen
        open_when_served = sum(h is None for h in held)
        meanwhile = _timed(serve)
    holding.join()
    with turn:
        at_end = _timed(serve)
    for sock in socks:
        sock.close()
    closed = [h for h in held if h is not None]
    return {"tried": count, "closed_by_server": len(closed) + (count - len(socks)), "deadline_s": deadline,
            "longest_held_s": round(max(closed, default=0.0), 2), "served_meanwhile_s": meanwhile,
            "open_when_served": open_when_served, "served_at_end_s": at_end}


def _client_put_get(master: str, token: str):
    def serve():
        key, value = f"hostile-sockets/{os.urandom(4).hex()}", os.urandom(2048)
        with Client(master, token=token) as client:
            client.put(key, value)
            if client.get(key) != value:
                raise AssertionError("read back something else")
    return serve


def _grpc_call(master: str, token: str):
    def serve():
        with blocking_channel(master, auth.Credential.for_client(token)) as channel:
            kvpool_pb2_grpc.MasterStub(channel).Stats(pb.StatsRequest(), timeout=5)
    return serve


def _http_get(address: str):
    def serve():
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as answer:
            if answer.status != 200:
                raise AssertionError(f"/healthz answered {answer.status}")
    return serve


def hostile_sockets(cluster, token: str, frame_timeout: float, connections: int = FLOOD) -> dict:
    """Every case against `cluster` (a LocalCluster with metrics on, its servers' --frame-timeout,
    --control-frame-timeout and --grpc-handshake-timeout `frame_timeout`, and connection caps below
    `connections`, CAPS); `connections` per flood and port."""
    nodes = [node.info["address"] for node in cluster.nodes]  # the put may land on any of them
    control = [cluster.master.info["control"]]
    health = f"{cluster.nodes[0].host}:{cluster.nodes[0].metrics_port}"
    put_get = _client_put_get(cluster.master_address, token)
    slow = {"slow_auth_node": (nodes, SLOW_CONNECTIONS, put_get, frame_timeout, _forged_auth()),
            "slow_auth_control": (control, SLOW_CONNECTIONS, put_get, frame_timeout, _forged_auth())}
    floods = {"flood_health": ([health], connections, _http_get(health), REQUEST_DEADLINE),  # longest: first
              "flood_node": (nodes, connections, put_get, frame_timeout),
              "flood_control": (control, connections, put_get, frame_timeout),
              "flood_grpc": ([cluster.master_address], connections, _grpc_call(cluster.master_address, token),
                             frame_timeout)}
    # The slow AUTHs, then the floods (which would displace the slow ones), each group at once: the run stays
    # short, and each real client of a flood meets all four floods held.
    report = {}
    with ThreadPoolExecutor(len(floods)) as pool:
        for cases in (slow, floods):
            turn = threading.Lock()
            running = {name: pool.submit(_case, turn, *arguments) for name, arguments in cases.items()}
            report.update((name, future.result()) for name, future in running.items())
    report["ok"] = all(held(case) for case in report.values())
    return report


def flood_case(address: str, serve, deadline: float, connections: int = FLOOD) -> dict:
    """One flood of idle connections against one HTTP port (e.g. the router's), timed as the cases above."""
    return _case(threading.Lock(), [address], connections, serve, deadline)


def held(case: dict) -> bool:
    """The case's connections were all closed by the server in time and the real client served."""
    return (_served(case) and case["closed_by_server"] == case["tried"] and bool(case["open_when_served"])
            and case["longest_held_s"] <= case["deadline_s"] + ACCEPT_SLACK)


def _served(case: dict) -> bool:
    return all(seconds is not None and seconds <= SERVED_WITHIN
               for seconds in (case["served_meanwhile_s"], case["served_at_end_s"]))
