"""Hostile peers against a cluster's etcd (called from benchmarks/hostile_peers.py).

- Without logging in, on the client port: read, write and delete the cluster's keys.
- Without the members' peer certificate, on the peer port (etcd's member-to-member HTTP API), the way a
  stranger who can reach it would: list the members (GET /members) and keep a lease alive (POST /leases with a
  LeaseKeepAliveRequest, what a member sends the leader on behalf of its clients), over plain HTTP, over TLS
  with no certificate, and over TLS with a certificate of another CA. The lease stands for a dead leader's:
  granted by a member and kept alive by nobody, so its time to live only falls unless the stranger renews it,
  which would keep the dead leader named and no other master taking over.
Every attempt must be refused (a refused TLS handshake is a refusal) and the lease not renewed.
"""

import asyncio
import http.client
import ssl
import tempfile
import urllib.error
import urllib.parse
import urllib.request

import aetcd
from aetcd import rpc

from kvpool.cluster.etcd_client import EtcdClient
from kvpool.launch.local_cluster import LocalCluster
from kvpool.security import auth
from kvpool.security.tls import make_local

LEASE_TTL = 10  # seconds: the stand-in for a dead leader's lease
FALLEN_BY = 2  # the stranger tries once its time to live has fallen this much: a renewal shows as a rise
ATTEMPT_TIMEOUT = 5.0


def etcd_without_login(cluster: LocalCluster) -> tuple[int, int]:
    """(tried, refused): reads, a write and deletes on etcd's client port without logging in."""
    async def attempts():
        host, port = cluster.etcd_endpoint.rsplit(":", 1)
        tried = refused = 0
        async with aetcd.Client(host=host, port=int(port), timeout=ATTEMPT_TIMEOUT) as etcd:
            for action in (lambda: etcd.get(b"/kvpool/default/master"), lambda: etcd.put(b"/kvpool/x", b"1"),
                           lambda: etcd.delete_prefix(b"/kvpool/"), lambda: etcd.get_prefix(b"/kvpool/")):
                tried += 1
                try:
                    await action()
                except aetcd.ClientError:
                    refused += 1
        return tried, refused

    return asyncio.run(attempts())


def _strangers(scratch: str) -> dict:
    """How a stranger dials the peer port: scheme and TLS context (None: plain HTTP)."""
    no_certificate = ssl.create_default_context()
    no_certificate.check_hostname, no_certificate.verify_mode = False, ssl.CERT_NONE
    another_ca = ssl.create_default_context()
    another_ca.check_hostname, another_ca.verify_mode = False, ssl.CERT_NONE
    own = make_local(scratch)  # a CA and certificate of its own making
    another_ca.load_cert_chain(own.cert, own.key)
    return {"plain": ("http", None), "tls_without_certificate": ("https", no_certificate),
            "tls_with_another_ca": ("https", another_ca)}


def _peer_call(url: str, context, body: bytes | None) -> bool:
    """True when etcd answered the call (200), False when it was refused in any way."""
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET",
                                     headers={"Content-Type": "application/protobuf"} if body else {})
    try:
        with urllib.request.urlopen(request, timeout=ATTEMPT_TIMEOUT, context=context) as reply:
            reply.read()
            return reply.status == 200
    except (urllib.error.URLError, http.client.HTTPException, OSError):  # refused, reset, handshake failed
        return False


async def _lease_ttl(etcd: EtcdClient, lease_id: int) -> int:
    return (await etcd.get_lease_info(lease_id, keys=False)).TTL


def peer_port(cluster: LocalCluster, secret: str) -> dict:
    """The stranger's attempts on etcd's peer port: tried, refused, members listed, whether the lease rose."""
    address = urllib.parse.urlsplit(cluster.etcd.peer_url)
    host, port = address.hostname, address.port

    async def run() -> dict:
        etcd_host, etcd_port = cluster.etcd_endpoint.rsplit(":", 1)
        async with EtcdClient(etcd_host, int(etcd_port), auth.Credential.for_member(secret),
                              timeout=ATTEMPT_TIMEOUT) as etcd:
            lease = await etcd.lease(LEASE_TTL)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + LEASE_TTL - 1
            while (before := await _lease_ttl(etcd, lease.id)) > LEASE_TTL - FALLEN_BY:
                if loop.time() > deadline:
                    raise TimeoutError(f"the lease's time to live stayed at {before}s")
                await asyncio.sleep(0.1)
            keepalive = rpc.LeaseKeepAliveRequest(ID=lease.id).SerializeToString()
            tried = answered = listed = 0
            with tempfile.TemporaryDirectory(prefix="kvpool-stranger-") as scratch:
                for scheme, context in _strangers(scratch).values():
                    base = f"{scheme}://{host}:{port}"
                    for path, body in (("/members", None), ("/leases", keepalive)):
                        tried += 1
                        ok = await asyncio.to_thread(_peer_call, base + path, context, body)
                        answered += ok
                        listed += ok and path == "/members"
            after = await _lease_ttl(etcd, lease.id)
            await etcd.revoke_lease(lease.id)
        return {"peer_calls_tried": tried, "peer_calls_refused": tried - answered, "members_listed": listed,
                "lease_ttl_before": before, "lease_ttl_after": after, "lease_renewed": after > before}

    return asyncio.run(run())


def held(report: dict) -> bool:
    """Every attempt on the peer port refused and the lease not renewed."""
    return report["peer_calls_refused"] == report["peer_calls_tried"] > 0 and not report["lease_renewed"]
