"""Hosts made of Linux network namespaces, for tests of kvpool spread over a network that can fail.

Each host is a network namespace with one interface ("eth0") and an address of a private /24; every host's
link is a veth pair whose other end is a port of a Linux bridge, and the bridge lives in a namespace of its
own, so nothing of this touches the machine's own namespace: no interface, route or address is added there,
and two runs (each with its own namespaces) can coexist. A process of a host runs in that host's network
namespace and in new UTS and mount namespaces: the host's name as hostname, and as /dev/shm the host's own
directory (SHM_ROOT/<namespace>, on the machine's /dev/shm tmpfs, bound over /dev/shm): the processes of one host
share it, those of other hosts do not see it, as on machines of their own.

A partition takes the host's port on the bridge down: from then on the bridge forwards nothing to or from
it, and nobody is told (no reset, no refusal; packets vanish), as when a switch port or a cable fails.
Healing takes it up again.

Needs root, `ip` (iproute2) and `unshare` (util-linux); `unavailable()` says why not when they are missing.
"""

import contextlib
import ipaddress
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

PREFIX = "kvpmh"  # every namespace this module makes is named PREFIX<owner pid>-<role>
_OURS = re.compile(rf"^{PREFIX}(\d+)-")
BRIDGE = "br0"
IP_TIMEOUT = 20.0  # seconds one `ip` command may take (they answer in milliseconds unless the box is stuck)

SHM_ROOT = "/dev/shm"

# What a host's process runs behind ($0: hostname, $1: its /dev/shm), then the command.
_HOST_SHELL = 'hostname "$0" && mount --bind "$1" /dev/shm && shift && exec "$@"'


def ip(*args: str, ns: str | None = None) -> str:
    """Run `ip [-n NS] ARGS`; returns its output, raises RuntimeError (with ip's message) if it fails."""
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as CI does)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace: {exc}"
    try:  # a veth pair proves the kernel has what the bridge needs too
        ip("link", "add", "probe0", "type", "veth", "peer", "name", "probe1", ns=probe)
        ip("link", "add", BRIDGE, "type", "bridge", ns=probe)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a veth pair or a bridge in a namespace: {exc}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=IP_TIMEOUT)
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").splitlines() if line.strip()]


def remove_leftovers() -> list[str]:
    """Delete namespaces of this naming scheme whose owning process is dead (an earlier run that crashed);
    returns their names. Those of live runs are left alone."""
    removed = []
    for name in namespaces():
        match = _OURS.match(name)
        if match and not _pid_alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=IP_TIMEOUT)
            removed.append(name)
    for entry in os.scandir(SHM_ROOT):
        match = _OURS.match(entry.name)
        if match and entry.is_dir(follow_symlinks=False) and not _pid_alive(int(match.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
    return removed


def _subnet_in_use(network: ipaddress.IPv4Network) -> bool:
    """Whether this machine's own namespace has an address or route in `network` (we would shadow nothing,
    being in namespaces of our own, but keep clear of it so that logs are never ambiguous)."""
    shown = ip("-4", "addr", "show") + ip("-4", "route", "show")
    return any(ipaddress.ip_address(a) in network for a in re.findall(r"\b(\d+\.\d+\.\d+\.\d+)\b", shown))


def pick_subnet(owner: int) -> ipaddress.IPv4Network:
    """A /24 of 10.77.0.0/16 derived from `owner` (a pid), skipping any in use on this machine."""
    for step in range(256):
        network = ipaddress.ip_network(f"10.77.{(owner + step) % 254 + 1}.0/24")
        if not _subnet_in_use(network):
            return network
    raise RuntimeError("no free /24 in 10.77.0.0/16")


@dataclass
class Host:
    """One machine: a network namespace with `address` on eth0, its port on the bridge named `port`."""

    name: str
    namespace: str
    address: str
    port: str

    @property
    def shm_dir(self) -> str:
        return os.path.join(SHM_ROOT, self.namespace)

    def command(self, argv) -> list:
        """`argv` run as a process of this host (its namespace, hostname and /dev/shm)."""
        return ["ip", "netns", "exec", self.namespace, "unshare", "--uts", "--mount", "sh", "-c", _HOST_SHELL,
                self.name, self.shm_dir, *map(str, argv)]

    def prefix(self) -> tuple:
        """What a command is run behind to be a process of this host (for kvpool.launch's prefix options)."""
        return tuple(self.command([]))


@dataclass
class CutSpan:
    """When a host was cut off and healed (time.monotonic)."""

    at: float
    healed: float = 0.0


class Network:
    """The bridge's namespace and the hosts joined to it; a context manager that deletes all of it on exit,
    whatever happened inside.

        with Network() as net:
            a, b = net.add_host("a"), net.add_host("b")
            subprocess.Popen(a.command(["python", ...]))
            net.partition(b); ...; net.heal(b)
    """

    def __init__(self, owner: int | None = None):
        self.owner = owner or os.getpid()
        self.tag = f"{PREFIX}{self.owner}"
        self.bridge_ns = f"{self.tag}-bridge"
        self.subnet: ipaddress.IPv4Network | None = None
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []

    def __enter__(self) -> "Network":
        why = unavailable()
        if why:
            raise OSError(why)
        remove_leftovers()
        self.subnet = pick_subnet(self.owner)
        try:
            self._add_namespace(self.bridge_ns)
            ip("link", "add", BRIDGE, "type", "bridge", ns=self.bridge_ns)
            ip("link", "set", BRIDGE, "up", ns=self.bridge_ns)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._made.append(name)
        ip("link", "set", "lo", "up", ns=name)

    def add_host(self, name: str) -> Host:
        """A new host called `name` (also its hostname), on the bridge with the next address of the subnet."""
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", name) or name in self.hosts:
            raise ValueError(f"host name must be new, lowercase alphanumeric, at most 10 characters: {name!r}")
        address = str(self.subnet.network_address + len(self.hosts) + 1)
        host = Host(name, f"{self.tag}-{name}", address, f"p{len(self.hosts)}")
        self._add_namespace(host.namespace)
        os.mkdir(host.shm_dir)
        os.chmod(host.shm_dir, 0o1777)
        # The pair is made in the bridge's namespace and one end moved to the host: nothing passes through ours.
        ip("link", "add", host.port, "type", "veth", "peer", "name", "eth0", ns=self.bridge_ns)
        ip("link", "set", "eth0", "netns", host.namespace, ns=self.bridge_ns)
        ip("link", "set", host.port, "master", BRIDGE, ns=self.bridge_ns)
        ip("link", "set", host.port, "up", ns=self.bridge_ns)
        ip("addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0", ns=host.namespace)
        ip("link", "set", "eth0", "up", ns=host.namespace)
        self.hosts[name] = host
        return host

    def partition(self, host: Host) -> None:
        """Cut `host` off silently: its port on the bridge goes down."""
        ip("link", "set", host.port, "down", ns=self.bridge_ns)

    def heal(self, host: Host) -> None:
        ip("link", "set", host.port, "up", ns=self.bridge_ns)

    @contextlib.contextmanager
    def cut(self, host: Host):
        """`host` cut off (partition) for the body of the `with`, healed after it even if it raises; yields the
        CutSpan, whose times (time.monotonic) are set as the cut and the heal happen."""
        span = CutSpan(time.monotonic())
        self.partition(host)
        try:
            yield span
        finally:
            self.heal(host)
            span.healed = time.monotonic()

    def cut_for(self, host: Host, seconds: float) -> "CutSpan":
        """`host` cut off for `seconds` (the length of the partition: the experiment, not a wait for anything)."""
        with self.cut(host) as span:
            time.sleep(seconds)
        return span

    def is_cut(self, host: Host) -> bool:
        return "state DOWN" in ip("link", "show", host.port, ns=self.bridge_ns)

    def close(self) -> None:
        """Delete every namespace this Network made (hosts first, then the bridge's); their veth pairs go with
        them. A process still running in one keeps its network alive but the name is gone: stop them first."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=IP_TIMEOUT)
            shutil.rmtree(os.path.join(SHM_ROOT, name), ignore_errors=True)
        self._made.clear()
        self.hosts.clear()
