"""The program a test runs inside a host (netns_hosts.py) to act from there: the test's own process stays in
the machine's namespace, where no host's address is reachable.

    python host_agent.py serve         JSON requests on stdin, one JSON answer a line on stdout (Agent in
                                       spread_cluster.py): probes (http, stats, enable_auth) and client calls
    python host_agent.py work SPEC     writers or readers of the register check (register_check.py) until a
                                       stop file appears; one JSON event a line to SPEC["out"]
    python host_agent.py watch SPEC    polls a master's /metrics and records whether it claims leadership
"""

import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request

from register_check import make_value, read_value

from kvpool import Client
from kvpool.errors import KvpoolError


def http_get(url: str, timeout: float = 2.0) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return {"status": answer.status, "body": answer.read().decode(errors="replace")}
    except urllib.error.HTTPError as exc:
        return {"status": exc.code, "body": exc.read().decode(errors="replace")}
    except OSError as exc:
        return {"status": 0, "error": f"{type(exc).__name__}: {exc}"}


def make_client(spec: dict) -> Client:
    """spec: {"masters": "A,B"} or {"etcd": "HOST:PORT"}, plus Client options (cluster, read_timeout, ...)."""
    options = {k: v for k, v in spec.items() if k not in ("masters", "etcd")}
    if spec.get("etcd"):
        return Client(etcd=spec["etcd"], **options)
    return Client(spec["masters"], **options)


def timed_put(client: Client, key: str, version: int, size: int, replicas: int,
              min_replicas: int | None = None) -> dict:
    value = make_value(key, version, size)
    t0 = time.monotonic()
    try:
        client.put(key, value, overwrite=True, replicas=replicas, min_replicas=min_replicas)
        ok, error = True, None
    except KvpoolError as exc:
        ok, error = False, type(exc).__name__
    return {"op": "put", "key": key, "version": version, "t0": t0, "t1": time.monotonic(), "ok": ok,
            "error": error}


def timed_get(client: Client, key: str) -> dict:
    t0 = time.monotonic()
    version, wrong = None, False
    try:
        value = client.get(key)
        version = read_value(key, value)
        wrong = version is None
        ok, error = not wrong, "wrong bytes" if wrong else None
    except KvpoolError as exc:
        ok, error = False, type(exc).__name__
    return {"op": "get", "key": key, "version": version, "wrong": wrong, "t0": t0, "t1": time.monotonic(),
            "ok": ok, "error": error}


# -- serve: requests from the test, answered in order


class Server:
    def __init__(self):
        self.clients: dict = {}

    def ping(self) -> dict:
        return {"hostname": os.uname().nodename, "shm": sorted(os.listdir("/dev/shm"))}

    def http(self, url: str, timeout: float = 2.0) -> dict:
        return http_get(url, timeout)

    def stats(self, masters: list) -> dict:
        from kvpool.launch.local_cluster import leading_master_stats
        from kvpool.security import auth

        try:
            stats = leading_master_stats(masters, auth.client_credential(None))
        except ConnectionError as exc:
            return {"error": str(exc)}
        return {"leader": stats.leader, "nodes": sorted(n.address for n in stats.nodes), "objects": stats.objects}

    def enable_auth(self, endpoint: str, secret: str) -> dict:
        from kvpool.cluster.etcd_client import enable_auth

        enable_auth(endpoint, secret)
        return {}

    def open(self, name: str, spec: dict) -> dict:
        self.clients[name] = make_client(spec)
        return {}

    def put(self, client: str, key: str, version: int, size: int, replicas: int = 1,
            min_replicas: int | None = None) -> dict:
        return timed_put(self.clients[client], key, version, size, replicas, min_replicas)

    def get(self, client: str, key: str) -> dict:
        return timed_get(self.clients[client], key)

    def close(self, client: str) -> dict:
        self.clients.pop(client).close()
        return {}


def serve() -> None:
    server = Server()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            answer = getattr(server, request.pop("op"))(**request)
        except Exception as exc:  # the test reads it as the answer; the agent keeps serving
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    for client in server.clients.values():
        client.close()


# -- work: writers and readers until the stop file appears


def _stopped(spec: dict) -> bool:
    return os.path.exists(spec["stop"]) or time.monotonic() > spec["deadline"]


def _writer(spec: dict, record, index: int, inflight: dict) -> None:
    client = make_client(spec["client"])
    keys = spec["keys"][index::spec["threads"]]
    versions = dict.fromkeys(keys, 0)
    pause = 1.0 / spec["rate"]
    try:
        while not _stopped(spec):
            for key in keys:
                versions[key] += 1
                inflight[index] = {"op": "put", "key": key, "version": versions[key], "t0": time.monotonic()}
                record(timed_put(client, key, versions[key], spec["size"], spec.get("replicas", 1)))
                del inflight[index]
                time.sleep(pause)  # pacing, not waiting for anything
                if _stopped(spec):
                    break
    finally:
        client.close()


def _reader(spec: dict, record, index: int, inflight: dict) -> None:
    client = make_client(spec["client"])
    chooser = random.Random(index)
    pause = 1.0 / spec["rate"]
    try:
        while not _stopped(spec):
            key = chooser.choice(spec["keys"])
            inflight[index] = {"op": "get", "key": key, "t0": time.monotonic()}
            record(timed_get(client, key))
            del inflight[index]
            time.sleep(pause)
    finally:
        client.close()


def work(spec: dict) -> None:
    """spec: name (tags its events "who"), role ("writer"/"reader"), client, keys, size, replicas, threads,
    rate (calls/s per thread), out (events file), stop (file whose existence ends the work), seconds (an upper
    bound all the same), grace (seconds a call may still run after the stop)."""
    spec["deadline"] = time.monotonic() + spec["seconds"]
    lock = threading.Lock()
    inflight: dict = {}  # thread index -> the call it is in
    with open(spec["out"], "a") as out:
        def record(event: dict) -> None:
            with lock:
                out.write(json.dumps({**event, "who": spec["name"]}) + "\n")
                out.flush()

        target = _writer if spec["role"] == "writer" else _reader
        threads = [threading.Thread(target=target, args=(spec, record, i, inflight), daemon=True)
                   for i in range(spec["threads"])]
        for thread in threads:
            thread.start()
        while not _stopped(spec):
            time.sleep(0.1)
        grace_end = time.monotonic() + spec.get("grace", 30)
        for thread in threads:  # a call stuck past the grace is a finding: recorded as such below, not awaited
            thread.join(max(0.0, grace_end - time.monotonic()))
        for call in dict(inflight).values():  # dict() copies it in one step (the threads may still change it)
            record({**call, "t1": time.monotonic(), "ok": False, "error": "still blocked at the end"})


def watch(spec: dict) -> None:
    """Every spec["interval"] s until the stop file: {"t", "leader": 1/0/None (unreachable)} to spec["out"]."""
    spec["deadline"] = time.monotonic() + spec["seconds"]
    with open(spec["out"], "a") as out:
        while not _stopped(spec):
            t = time.monotonic()
            answer = http_get(spec["url"], timeout=1.0)
            leader = None
            for line in answer.get("body", "").splitlines():
                if line.startswith("kvpool_master_leader "):
                    leader = int(float(line.split()[1]))
            out.write(json.dumps({"t": t, "leader": leader}) + "\n")
            out.flush()
            time.sleep(spec["interval"])


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "serve":
        serve()
    else:
        {"work": work, "watch": watch}[mode](json.loads(sys.argv[2]))
