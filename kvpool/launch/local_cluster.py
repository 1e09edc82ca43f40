"""A whole kvpool cluster as child processes on 127.0.0.1: etcd, M masters (one leads), N storage nodes.

`kvpool up` runs one for people; the end-to-end tests run the same thing, so what
the tests prove is what a user starts.
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..security import auth
from ..protocol.cluster_layout import DEFAULT_CLUSTER
from ..cluster.etcd_client import enable_auth
from .etcd_server import EtcdServer, etcd_cluster
from ..net.netutil import free_port, wait_until

_READY = re.compile(r"^kvpool-(master|storenode) ready (.*)$", re.MULTILINE)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@dataclass
class Child:
    """One component process; its stdout and stderr go to files under the cluster's log dir."""

    name: str
    argv: list
    log_dir: Path
    proc: subprocess.Popen | None = None
    info: dict = field(default_factory=dict)  # fields of the ready line: address=..., node_id=...
    metrics_port: int = 0  # its Prometheus endpoint, when the cluster runs with metrics
    host: str = "127.0.0.1"  # the address it serves on

    @property
    def out_path(self) -> Path:
        return self.log_dir / f"{self.name}.out"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self, timeout: float) -> "Child":
        self.out_path.write_bytes(b"")
        with open(self.out_path, "ab") as out, open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=err, start_new_session=True)
        wait_until(self._ready, timeout, what=f"{self.name} to be ready (log: {self.log_path})")
        return self

    def _ready(self) -> bool:
        match = _READY.search(self.out_path.read_text(errors="replace"))
        if match:
            self.info = dict(part.split("=", 1) for part in match.group(2).split())
            return True
        if self.proc.poll() is not None:
            tail = self.log_path.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{tail}")
        return False

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        return None if self.proc is None else stop_process(self.proc, timeout)

    def wait(self, timeout: float) -> int | None:
        """Its exit code once it exits by itself (after a signal), killed past `timeout` seconds."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL: the process gets no chance to clean up (its etcd lease must expire)."""
        if self.alive:
            self.proc.kill()
            self.proc.wait()


class LocalCluster:
    def __init__(self, nodes: int = 2, dram_per_node: str = "256MiB", data_dir: str | os.PathLike | None = None,
                 master_port: int = 0, cluster: str = DEFAULT_CLUSTER, lease_ttl: float | None = None,
                 put_timeout: float | None = None, metrics: bool = False, host: str = "127.0.0.1",
                 ssd_per_node: str = "0", node_args: list | None = None, master_args: list | None = None,
                 masters: int = 1, etcd_members: int = 1, secret: str | None = None, tls: bool = False,
                 shared_dir: str | os.PathLike | None = None, shared_capacity: str | None = None,
                 object_store: str | None = None):
        """node_args / master_args: extra command-line options for every storage node / every master.
        masters: how many masters run; the first one started leads at first, the others stand by.
        etcd_members: size of the etcd cluster (components talk to its first member).
        secret: the cluster secret ("" for none: every port open); default: the one this process was
        given ($KVPOOL_TOKEN_FILE / $KVPOOL_TOKEN) if it is a secret, else the one kept in the data dir,
        else a new one kept there. Its client token is written next to it (`client_token_file`), and
        a process that had no token of its own is given that one ($KVPOOL_TOKEN_FILE) while the cluster
        runs, so the clients it makes and the engines it starts belong to the cluster.
        tls: every component serves TLS with a CA and certificate made in DATA_DIR/tls (kvpool/security/tls.py);
        a process without $KVPOOL_TLS_CA is given that CA the same way.
        shared_dir: every node mounts it as the shared tier (--shared-dir), within `shared_capacity` (a size).
        object_store: the shared tier in a bucket (--object-store s3://BUCKET/PREFIX; with shared_dir, beneath it),
        or "local": an S3 server run here over DATA_DIR/objects (kvpool/launch/s3_server.py), its address and key
        given to this process's environment (as the token is) while the cluster runs; "local?encryption=aes-gcm"
        encrypts."""
        if masters < 1:
            raise ValueError(f"masters must be at least 1, got {masters}")
        self.master_count = masters
        self.etcd_members = etcd_members
        self._tmp = None if data_dir else tempfile.TemporaryDirectory(prefix="kvpool-")
        self.data_dir = Path(data_dir or self._tmp.name).resolve()
        self.log_dir = self.data_dir / "logs"
        self.host = host
        self.node_count = nodes
        self.dram_per_node = dram_per_node
        self.ssd_per_node = ssd_per_node
        self.shared_dir = Path(shared_dir).resolve() if shared_dir else None
        self.shared_capacity = shared_capacity
        self.object_store = self._object_store_asked = object_store
        self.s3_server = None  # the local S3 server of object_store="local"
        self._gave_env: list[str] = []
        self.node_args = list(node_args or [])
        self.master_args = list(master_args or [])
        self.master_port = master_port
        self.cluster = cluster
        self.lease_ttl = lease_ttl
        self.put_timeout = put_timeout
        self.metrics = metrics
        self.secret = secret
        self._gave_token = False
        self._gave_ca = False
        self.tls = tls
        self.tls_files = None  # kvpool/security/tls.py TlsFiles once started with tls
        self.etcd: EtcdServer | None = None
        self.etcd_servers: list[EtcdServer] = []
        self.master: Child | None = None  # the first master (the leader once start() returns)
        self.masters: list[Child] = []
        self.nodes: list[Child] = []

    @property
    def master_address(self) -> str:
        return self.master.info["address"]

    @property
    def master_addresses(self) -> str:
        """Every master, comma-separated: what a client given all of them follows leadership with."""
        return ",".join(m.info["address"] for m in self.masters)

    def leader_address(self) -> str:
        """The address of the master leading now, as the masters' Stats say."""
        return self.master_stats().leader or self.master_address

    @property
    def secret_file(self) -> Path:
        return self.data_dir / "secret"

    @property
    def client_token_file(self) -> Path:
        """What clients of this cluster are given (KVPOOL_TOKEN_FILE): proves the client role only."""
        return self.data_dir / "client.token"

    @property
    def client_token(self) -> str:
        return auth.client_token(self.secret) if self.secret else ""

    @property
    def client_credential(self) -> "auth.Credential | None":
        return auth.Credential.for_client(self.client_token) if self.secret else None

    def add_tenant(self, name: str, timeout: float = 10.0, **limits) -> str:
        """Create tenant `name` (limits as Client.tenants takes them); its token, once the leader and every
        node take it (their records come from etcd a watch event later)."""
        from ..client import Client

        with Client(self.master_address, token=self.secret) as operator:
            [record] = operator.tenants("create", name, **limits)
            nodes = [node.address for node in operator.stats().nodes]
        token = auth.tenant_token(self.secret, name, record.version)
        wait_until(lambda: self.takes(token, nodes), timeout, what=f"every node and master to take tenant {name}")
        return token

    def takes(self, token: str, nodes: list) -> bool:
        """Whether the leader and each node at `nodes` (HOST:PORT) take `token` (a handshake proves it)."""
        import socket

        from ..client import Client
        from ..errors import KvpoolError
        from ..protocol.cluster_layout import parse_hostport

        credential = auth.Credential.for_client(token)
        try:
            with Client(self.master_address, token=token) as client:
                client.stats()
            for address in nodes:
                host, port = parse_hostport(address)
                with socket.create_connection((host, port), timeout=2.0) as plain:
                    sock = self.tls_files.client_context().wrap_socket(plain, server_hostname=host) \
                        if self.tls_files else plain
                    auth.handshake_blocking(sock, credential, address)
        except (KvpoolError, OSError):
            return False
        return True

    def _keep_secret(self) -> None:
        if self.secret is None:
            given = auth.read_token()
            if given and not given.startswith(auth.CLIENT_TOKEN_PREFIX):
                self.secret = given
            elif self.secret_file.exists():
                self.secret = auth.read_token(self.secret_file)
            else:
                self.secret = auth.new_secret()
        if self.secret:
            auth.checked_secret(self.secret, "the cluster's secret")  # before its members refuse it
            auth.write_private(self.secret_file, self.secret)
            auth.write_private(self.client_token_file, self.client_token)
            if auth.read_token() is None:
                os.environ["KVPOOL_TOKEN_FILE"] = str(self.client_token_file)
                self._gave_token = True

    def _security_args(self) -> list:
        tls = ["--tls-dir", str(self.tls_files.cert.parent)] if self.tls_files else []
        return (["--token-file", str(self.secret_file)] if self.secret else []) + tls

    def _make_tls(self) -> None:
        from ..security.tls import make_local

        self.tls_files = make_local(self.data_dir / "tls", hosts=sorted({self.host, "127.0.0.1", "localhost"}))
        if not os.environ.get("KVPOOL_TLS_CA"):
            os.environ["KVPOOL_TLS_CA"] = str(self.tls_files.ca)
            self._gave_ca = True

    @property
    def etcd_endpoint(self) -> str:
        return self.etcd.endpoint

    def _placement(self, name: str) -> tuple[str, tuple]:
        """(address to serve on, command prefix) of component `name`: all on self.host here; a cluster
        spread over network namespaces (tests/multihost) gives each its own."""
        return self.host, ()

    def _free_port(self, host: str) -> int:
        return free_port(host)

    def _child(self, name: str, argv: list, host: str | None = None) -> Child:
        """A component's Child, with a Prometheus port of its own when metrics are on."""
        host = host or self.host
        port = self._free_port(host) if self.metrics else 0
        return Child(name, argv + (["--metrics-port", str(port)] if port else []), self.log_dir, metrics_port=port,
                     host=host)

    @property
    def metrics_urls(self) -> dict:
        return {c.name: f"http://{c.host}:{c.metrics_port}/metrics"
                for c in [*self.masters, *self.nodes] if c is not None and c.metrics_port}

    def start(self, timeout: float = 60.0) -> "LocalCluster":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._keep_secret()
        if self.tls:
            self._make_tls()
        try:
            self._start_object_store(timeout)
            self._start_etcd(timeout)
            if self.secret:  # members log in as one etcd user, clients (read only) as another
                self._enable_etcd_auth()
            self.master = self._start_master(0, timeout)
            self.masters = [self.master]
            for index in range(1, self.master_count):
                self.masters.append(self._start_master(index, timeout))
            self.nodes = [self._node_child(i) for i in range(self.node_count)]
            for node in self.nodes:
                node.start(timeout)
            self.wait_for_nodes(self.node_count, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_object_store(self, timeout: float) -> None:
        where, _, options = (self.object_store or "").partition("?")  # local?encryption=aes-gcm: options kept
        if where != "local":
            return
        from .s3_server import local_store

        self.s3_server = local_store(self.data_dir).start(timeout)
        self.object_store = f"s3://{self.s3_server.bucket}/" + (f"?{options}" if options else "")
        for name, value in self.s3_server.environment.items():
            if name not in os.environ:
                os.environ[name] = value
                self._gave_env.append(name)

    def _start_etcd(self, timeout: float) -> None:
        if self.etcd_members > 1:
            self.etcd_servers = etcd_cluster(self.data_dir / "etcd", self.etcd_members, self.host, timeout)
            self.etcd = self.etcd_servers[0]  # every component talks to this member
        else:
            self.etcd = EtcdServer(self.data_dir / "etcd", host=self.host,
                                   log_path=self.log_dir / "etcd.log", tls=self.tls_files).start(timeout)
            self.etcd_servers = [self.etcd]

    def _enable_etcd_auth(self) -> None:
        enable_auth(self.etcd.endpoint, self.secret, tls=self.tls_files)

    @staticmethod
    def _given(flag: str, value) -> list:
        """The flag when a value was given (else the component's own default, or its config file's, holds)."""
        return [] if value is None else [flag, str(value)]

    def _start_master(self, index: int, timeout: float) -> Child:
        """Start master `index`. A free port picked for it may be taken by another process before the
        master binds it (the master refuses a taken port): it is then started again on another."""
        for attempt in range(3):
            try:
                return self._master_child(index).start(timeout)
            except RuntimeError as exc:
                if (index == 0 and self.master_port) or "cannot listen" not in str(exc) or attempt == 2:
                    raise

    def _master_child(self, index: int = 0) -> Child:
        name = "master" if index == 0 else f"master-{index}"
        host, prefix = self._placement(name)
        port = self.master_port if index == 0 and self.master_port else self._free_port(host)
        argv = [*prefix, sys.executable, "-m", "kvpool.master", "--etcd", self.etcd_endpoint, "--host", host,
                "--port", str(port), "--cluster", self.cluster, "--master-id", name,
                *self._given("--put-timeout", self.put_timeout), *self._security_args(), *self.master_args]
        return self._child(name, argv, host)

    def restart_master(self, index: int, timeout: float = 30.0) -> Child:
        """Start master `index` again (after a stop or kill) on a new port."""
        self.masters[index].stop()
        self.masters[index] = self._start_master(index, timeout)
        if index == 0:
            self.master = self.masters[0]
        return self.masters[index]

    def _node_child(self, index: int, host: str | None = None, prefix: tuple = ()) -> Child:
        node_id = f"node-{index}"
        if host is None:
            host, prefix = self._placement(node_id)
        argv = [*prefix, sys.executable, "-m", "kvpool.storenode", "--etcd", self.etcd_endpoint,
                "--host", host,
                "--port", "0", "--cluster", self.cluster, "--node-id", node_id, "--dram", str(self.dram_per_node),
                "--data-dir", str(self.data_dir / node_id), *self._given("--lease-ttl", self.lease_ttl),
                "--ssd", str(self.ssd_per_node), *self._shared_args(), *self._security_args(), *self.node_args]
        return self._child(node_id, argv, host)

    def _shared_args(self) -> list[str]:
        """The directory, the bucket, or both (the bucket beneath the directory)."""
        argv = ["--object-store", self.object_store] if self.object_store else []
        if self.shared_dir is not None:
            self.shared_dir.mkdir(parents=True, exist_ok=True)  # (a node takes only a directory that exists: a mount)
            argv += ["--shared-dir", str(self.shared_dir)]
        return argv + self._given("--shared-capacity", self.shared_capacity) if argv else []

    def add_node(self, host: str, prefix: tuple = (), timeout: float = 30.0) -> Child:
        """Start one more storage node serving on `host`, its command run behind `prefix`
        (e.g. ("ip", "netns", "exec", NS) to put it in another network namespace)."""
        node = self._node_child(len(self.nodes), host, prefix).start(timeout)
        self.nodes.append(node)
        return node

    def restart_node(self, index: int, timeout: float = 30.0) -> Child:
        """Start node `index` again (after a stop or kill) with the same id and data dir."""
        self.nodes[index].stop()
        self.nodes[index] = self._node_child(index).start(timeout)
        return self.nodes[index]

    def master_stats(self):
        """The leading master's Stats reply (a blocking gRPC call, for waiting and tests)."""
        alive = [m for m in self.masters if m.alive] or [self.master]
        return leading_master_stats([m.info["address"] for m in alive], self.client_credential, self.tls_files)

    def wait_for_nodes(self, count: int, timeout: float = 30.0) -> None:
        """Until the master's membership lists exactly `count` storage nodes."""
        wait_until(lambda: len(self.master_stats().nodes) == count, timeout,
                   what=f"the master to list {count} storage nodes")

    def stop(self) -> None:
        from ..storenode.background.stop_keep import STOP_GRACE
        from ..storenode.storage.dram import remove_stale_segments

        # Every node at once, as Ctrl-C on `kvpool up` signals them: each keeps what it holds in the shared tier
        # within its grace (a node without one finds no other to hand its objects to, and leaves).
        for child in self.nodes:
            child.signal(signal.SIGTERM)
        for child in self.nodes:
            child.wait(STOP_GRACE + 5)
        for child in self.masters or [self.master]:
            if child is not None:
                child.stop()
        for node in self.nodes:  # a node that was killed could not unlink its DRAM segment itself
            remove_stale_segments(self.cluster, node.name)
        for server in {id(s): s for s in [*self.etcd_servers, self.etcd] if s is not None}.values():
            server.stop()  # self.etcd too: a caller may have replaced it with a restarted member
        if self.s3_server is not None:
            self.s3_server.stop()
            self.object_store = self._object_store_asked  # started again, it starts its server again
        for name in self._gave_env:
            os.environ.pop(name, None)
        self._gave_env = []
        if self._gave_token and os.environ.get("KVPOOL_TOKEN_FILE") == str(self.client_token_file):
            del os.environ["KVPOOL_TOKEN_FILE"]
            self._gave_token = False
        if self._gave_ca and self.tls_files and os.environ.get("KVPOOL_TLS_CA") == str(self.tls_files.ca):
            del os.environ["KVPOOL_TLS_CA"]
            self._gave_ca = False
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def leading_master_stats(addresses: list, credential=None, tls=None):
    """The Stats reply of the master among `addresses` that says it leads (else the last one that answered);
    ConnectionError if none answers. A blocking gRPC call, for waiting and tests."""
    import grpc

    from ..proto import kvpool_pb2, kvpool_pb2_grpc
    from ..security.grpc_auth import blocking_channel

    stats = None
    for address in addresses:
        with blocking_channel(address, credential, tls=tls) as channel:
            try:
                stats = kvpool_pb2_grpc.MasterStub(channel).Stats(kvpool_pb2.StatsRequest(), timeout=5)
            except grpc.RpcError:
                continue
        if stats.leader in ("", address):
            return stats
    if stats is None:
        raise ConnectionError("no master answered Stats")
    return stats


def wait_for_signal() -> int:
    """Block until SIGINT or SIGTERM; returns the signal number."""
    received = []
    arrived = threading.Event()

    def handler(signum, _frame):
        received.append(signum)
        arrived.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    # Not signal.pause(): a signal landing between the check and the pause would leave it waiting forever (the
    # handler runs only once the pause returns). A wait with a timeout rechecks within a second whatever happens.
    while not arrived.wait(1.0):
        pass
    return received[0]
