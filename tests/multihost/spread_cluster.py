"""A real kvpool cluster spread over hosts made of network namespaces (netns_hosts.py): etcd, each master and
each storage node on a host of its own, serving on that host's address, and clients on further hosts.

It is kvpool.launch's LocalCluster with every component placed on its own host: the same command lines, the
same ready lines. What LocalCluster does over the network from the test's process (etcd's health, enabling
etcd's auth, the masters' Stats) goes through an Agent in a client host instead, as no host's address is
reachable from the machine's own namespace.
"""

import json
import selectors
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from netns_hosts import Host, Network

from kvpool.launch.etcd_server import EtcdServer
from kvpool.launch.local_cluster import LocalCluster, stop_process
from kvpool.net.netutil import wait_until

AGENT = Path(__file__).with_name("host_agent.py")
ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380
FIRST_PORT = 7000  # a host's namespace is ours alone: every port in it is free, so ports are dealt in order


class Agent:
    """A host_agent.py `serve` process in a host: call(op, ...) sends one request and reads its answer."""

    def __init__(self, host: Host, log_path: Path, timeout: float = 30.0):
        self.host = host
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(host.command([sys.executable, str(AGENT), "serve"]),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                         start_new_session=True)
        self.log_path = log_path
        self._read(timeout)

    def _read(self, timeout: float) -> dict:
        with selectors.DefaultSelector() as selector:
            selector.register(self.proc.stdout, selectors.EVENT_READ)
            if not selector.select(timeout):
                raise TimeoutError(f"the agent on {self.host.name} did not answer in {timeout:.0f} s "
                                   f"(log: {self.log_path})")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the agent on {self.host.name} exited with {self.proc.wait()} "
                               f"(log: {self.log_path})")
        return json.loads(line)

    def call(self, op: str, deadline: float = 30.0, **args) -> dict:
        """The agent's answer; {"error": ...} when its call raised. An agent that has not answered within
        `deadline` seconds is stopped (it may be stuck in the call) and TimeoutError raised."""
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()
        try:
            return self._read(deadline)
        except TimeoutError:
            self.close()
            raise

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            stop_process(self.proc, timeout=5)


class _NamespacedEtcd(EtcdServer):
    """etcd in a host, its health asked by an agent (this process cannot reach it)."""

    def __init__(self, probe: Agent, *args, **options):
        super().__init__(*args, **options)
        self.probe = probe

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {self.proc.returncode}; see {self.log_path}")
        return '"true"' in self.probe.call("http", url=f"http://{self.endpoint}/health").get("body", "")


class SpreadCluster(LocalCluster):
    """etcd, `masters` masters and `nodes` storage nodes, each on a host of `network`, and `clients` hosts
    for client processes (client0, ...; the first also runs the probe agent).

        with Network() as net, SpreadCluster(net, nodes=2, data_dir=...) as cluster:
            cluster.host_of("node-0"), cluster.client_hosts[0], cluster.probe.call(...)
    """

    def __init__(self, network: Network, nodes: int = 2, masters: int = 1, clients: int = 1, **options):
        options.setdefault("cluster", f"mh{network.owner}")  # nothing shared with another run's segments
        super().__init__(nodes=nodes, masters=masters, **options)
        self.network = network
        self.client_hosts = [network.add_host(f"client{i}") for i in range(clients)]
        self._ports: dict = {}
        self.agents: list[Agent] = []
        self.probe: Agent | None = None

    @staticmethod
    def host_name(component: str) -> str:
        """The host a component runs on: "master" -> master0, "master-1" -> master1, "node-0" -> node0."""
        return {"master": "master0"}.get(component, component.replace("-", ""))

    def host_of(self, component: str) -> Host:
        name = self.host_name(component)
        return self.network.hosts.get(name) or self.network.add_host(name)

    def _placement(self, name: str) -> tuple[str, tuple]:
        host = self.host_of(name)
        return host.address, host.prefix()

    def _free_port(self, host: str) -> int:
        self._ports[host] = self._ports.get(host, FIRST_PORT - 1) + 1
        return self._ports[host]

    def agent(self, host: Host) -> Agent:
        """A new agent on `host` (stopped with the cluster)."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        agent = Agent(host, self.log_dir / f"agent-{host.name}-{len(self.agents)}.log")
        self.agents.append(agent)
        return agent

    def _start_etcd(self, timeout: float) -> None:
        host = self.host_of("etcd")
        self.probe = self.agent(self.client_hosts[0])
        self.etcd = _NamespacedEtcd(self.probe, self.data_dir / "etcd", host=host.address,
                                    client_port=ETCD_CLIENT_PORT, peer_port=ETCD_PEER_PORT,
                                    log_path=self.log_dir / "etcd.log", prefix=host.prefix()).start(timeout)
        self.etcd_servers = [self.etcd]

    def _enable_etcd_auth(self) -> None:
        answer = self.probe.call("enable_auth", endpoint=self.etcd.endpoint, secret=self.secret)
        if "error" in answer:
            raise RuntimeError(f"enabling etcd's auth failed: {answer['error']}")

    def master_stats(self):
        """The leading master's Stats as the probe agent sees them: leader, nodes (addresses), objects."""
        alive = [m for m in self.masters if m.alive] or [self.master]
        answer = self.probe.call("stats", masters=[m.info["address"] for m in alive])
        if "error" in answer:
            raise ConnectionError(answer["error"])
        return SimpleNamespace(**answer)

    def metrics_url(self, component: str) -> str:
        child = next(c for c in [*self.masters, *self.nodes] if c.name == component)
        return f"http://{child.host}:{child.metrics_port}/metrics"

    def run(self, host: Host, mode: str, spec: dict, name: str) -> subprocess.Popen:
        """host_agent.py MODE SPEC as a process of `host` (work, watch); the caller waits for it."""
        with open(self.log_dir / f"{name}.log", "ab") as log:
            return subprocess.Popen(host.command([sys.executable, str(AGENT), mode, json.dumps(spec)]),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_for_leader(self, timeout: float = 30.0, other_than: str = "") -> str:
        """Until the masters name a leader (other than `other_than`); returns its address."""
        def leader():
            try:
                found = self.master_stats().leader
            except ConnectionError:
                return None
            return found if found and found != other_than else None

        return wait_until(leader, timeout, interval=0.1, what="a leader" + (f" other than {other_than}"
                                                                            if other_than else ""))

    def stop(self) -> None:
        for agent in self.agents:
            agent.close()
        super().stop()


def wait_for_exit(procs: list, timeout: float) -> int:
    """Until every process in `procs` has exited; those still running after `timeout` seconds are stopped.
    Returns how many had to be."""
    deadline = time.monotonic() + timeout
    stopped = 0
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stop_process(proc, timeout=5)
            stopped += 1
    return stopped
