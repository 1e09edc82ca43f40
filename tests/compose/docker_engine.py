"""A Docker engine of the tests' own: dockerd in a network namespace made for it (no container traffic leaves it),
its data under the test's directory, the vfs storage driver and no iptables rules of its own (as this machine
allows), reached through a socket of its own. Nothing of the machine's own Docker, if any, is touched."""

import os
import shutil
import signal
import subprocess
from pathlib import Path

from kvpool.net.netutil import wait_until

TOOLS = ("dockerd", "docker", "docker-compose", "debootstrap", "ip", "nsenter")


def unavailable() -> str | None:
    """Why no engine can be started here, or None."""
    if os.geteuid() != 0:
        return "needs root (a network namespace and a Docker daemon of the test's own)"
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"{', '.join(missing)} not installed (Debian: apt-get install docker.io docker-compose debootstrap)"
    return None


class DockerEngine:
    def __init__(self, root: Path):
        self.root = root
        self.namespace = f"kvpool-docker-{os.getpid()}"
        self.socket = root / "docker.sock"
        self.env = {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "DockerEngine":
        subprocess.run(["ip", "netns", "add", self.namespace], check=True)
        subprocess.run(["ip", "netns", "exec", self.namespace, "ip", "link", "set", "lo", "up"], check=True)
        # nsenter, not `ip netns exec`: that one remounts /sys, hiding the cgroups dockerd needs.
        with open(self.root / "dockerd.log", "wb") as log:
            self.proc = subprocess.Popen(
                ["nsenter", f"--net=/var/run/netns/{self.namespace}", "dockerd", "--storage-driver", "vfs",
                 "--iptables=false", "--ip6tables=false", "--bridge=none", "--data-root", str(self.root / "data"),
                 "--exec-root", str(self.root / "exec"), "--pidfile", str(self.root / "dockerd.pid"),
                 "-H", f"unix://{self.socket}"], stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._answers, timeout, what="the test's dockerd to answer")
        return self

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"dockerd exited with {self.proc.returncode}: "
                               f"{(self.root / 'dockerd.log').read_text()[-2000:]}")
        return self.docker("info", check=False, capture=True).returncode == 0

    def docker(self, *args, check: bool = True, capture: bool = False, timeout: float = 300.0, cwd=None):
        return subprocess.run(["docker", *args], env=self.env, check=check, cwd=cwd, timeout=timeout,
                              capture_output=capture, text=True)

    def compose(self, project_dir: Path, project: str, *args, check: bool = True, timeout: float = 300.0):
        return subprocess.run(["docker-compose", "-p", project, *args], env=self.env, cwd=project_dir, check=check,
                              timeout=timeout, capture_output=True, text=True)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            running = self.docker("ps", "-q", check=False, capture=True).stdout.split()
            if running:
                self.docker("kill", *running, check=False, capture=True)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        subprocess.run(["ip", "netns", "delete", self.namespace], check=False, capture_output=True)
