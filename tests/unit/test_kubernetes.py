"""deploy/kubernetes: every manifest valid for Kubernetes 1.37 (kubernetes-validate's schemas, offline), the
objects referring to each other correctly (Services to pods and their ports, Secrets and their keys, the
ConfigMap and the config file in it), rendered through kustomize when kubectl is here."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvpool.runtime import config
from kvpool.commands.cli import command_parsers

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
VERSION = "1.37.0"
# What the base expects the overlays to make (its kustomization.yaml says so).
SECRET_KEYS = {"kvpool-secret": {"secret", "client.token"}, "kvpool-tls": {"ca.pem", "cert.pem", "key.pem"},
               "kvpool-etcd-peer": {"ca.pem", "cert.pem", "key.pem"}}
WORKLOADS = ("StatefulSet", "Deployment", "Job")


def base_objects() -> list[dict]:
    kustomization = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())
    objects = [doc for name in kustomization["resources"]
               for doc in yaml.safe_load_all((KUBE / "base" / name).read_text()) if doc]
    [generated] = kustomization["configMapGenerator"]
    objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generated["name"]},
                    "data": {f: (KUBE / "base" / f).read_text() for f in generated["files"]}})
    return objects


def validate(objects: list[dict]) -> None:
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # the Prometheus operator's own kinds: not in Kubernetes' schemas
        kubernetes_validate.validate(obj, VERSION, strict=True)


def named(objects, kind) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def base_name(name: str, known) -> str:
    """kustomize suffixes generated names with a hash: kvpool-config-g85ck6mt98 -> kvpool-config."""
    return next((k for k in known if name == k or name.rsplit("-", 1)[0] == k), name)


def check_references(objects: list[dict], secrets: dict[str, set]) -> None:
    services, config_maps = named(objects, "Service"), named(objects, "ConfigMap")
    pods = {o["metadata"]["name"]: o["spec"]["template"] for o in objects if o["kind"] in WORKLOADS}
    assert pods
    for name, template in pods.items():
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        owner = next(o for o in objects if o["kind"] in WORKLOADS and o["metadata"]["name"] == name)
        claims = {c["metadata"]["name"] for c in owner["spec"].get("volumeClaimTemplates", [])}
        for volume in volumes.values():
            if "secret" in volume:
                secret = base_name(volume["secret"]["secretName"], secrets)
                assert secret in secrets, (name, secret)
                for item in volume["secret"].get("items", []):
                    assert item["key"] in secrets[secret], (name, secret, item["key"])
            if "configMap" in volume:
                assert volume["configMap"]["name"] in config_maps, (name, volume["configMap"]["name"])
        for container in spec["containers"]:
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes or mount["name"] in claims, (name, mount["name"])
            for probe in ("readinessProbe", "livenessProbe"):
                check = container.get(probe)
                if check:
                    port = (check.get("httpGet") or check.get("grpc") or check.get("tcpSocket"))["port"]
                    assert port in ports or port in ports.values(), (name, probe, port)
            if container["args"][:1] in (["master"], ["storenode"]):
                check_config(container, ports, config_maps, services)
        if owner["kind"] == "StatefulSet":
            service = services[owner["spec"]["serviceName"]]
            assert service["spec"].get("clusterIP") == "None", name  # stable per-pod DNS names
    for name, service in services.items():
        selector = service["spec"]["selector"]
        matching = [t for t in pods.values() if selector.items() <= t["metadata"]["labels"].items()]
        assert matching, f"Service {name} selects no pods"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in {p["name"] for c in t["spec"]["containers"] for p in c.get("ports", [])}
                       for t in matching), (name, target)
    for name, budget in named(objects, "PodDisruptionBudget").items():
        selector = budget["spec"]["selector"]["matchLabels"]
        assert any(selector.items() <= t["metadata"]["labels"].items() for t in pods.values()), name


def check_config(container, ports, config_maps, services) -> None:
    """The config file a component reads is one kvpool takes, and names the ports and Services that exist."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    path = Path(env["KVPOOL_CONFIG"])
    [config_map] = [c for c in config_maps.values() if path.name in c["data"]]
    text = config_map["data"][path.name]
    tables = tomllib.loads(text)
    command = container["args"][0]
    parser = command_parsers()[command]
    values, _ = config.settings(parser, command, [], tables, path)  # raises on any key it does not take
    assert values["port"] == ports[{"master": "grpc", "storenode": "data"}[command]]
    assert values["metrics_port"] == ports["metrics"]
    etcd_host, etcd_port = values["etcd"].split(":")
    assert int(etcd_port) in {p["port"] for p in services[etcd_host]["spec"]["ports"]}
    for name, value in env.items():
        if name.startswith(f"KVPOOL_{command.upper()}_"):
            assert name.removeprefix(f"KVPOOL_{command.upper()}_").lower() in config.options(parser), name


def test_base_manifests_are_valid_and_refer_to_each_other():
    objects = base_objects()
    validate(objects)
    check_references(objects, SECRET_KEYS)


def test_servicemonitor_selects_the_metrics_ports():
    [monitor] = yaml.safe_load_all((KUBE / "components" / "servicemonitor" / "servicemonitor.yaml").read_text())
    services = [o for o in base_objects() if o["kind"] == "Service"]
    scraped = [s for s in services if any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    assert {s["metadata"]["name"] for s in scraped} == {"kvpool-master", "kvpool-node"}
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its kustomize) is not installed")
def test_small_overlay_renders_valid_and_consistent(tmp_path):
    tree = tmp_path / "kubernetes"
    shutil.copytree(KUBE, tree)
    overlay = tree / "overlays" / "small"
    kvpool = [sys.executable, "-m", "kvpool.commands.cli"]
    (overlay / "secret").write_text(subprocess.run(kvpool + ["token", "new"], capture_output=True, text=True,
                                                   check=True).stdout)
    (overlay / "secret").chmod(0o600)
    (overlay / "client.token").write_text(subprocess.run(kvpool + ["token", "client", "--token-file",
                                                                   str(overlay / "secret")],
                                                         capture_output=True, text=True, check=True).stdout)
    subprocess.run(kvpool + ["tls", str(overlay / "tls"), "--hosts", "kvpool-etcd,*.kvpool-etcd,*.kvpool-master,"
                             "*.kvpool-node"], capture_output=True, check=True)
    subprocess.run(kvpool + ["tls", str(overlay / "etcd-peer"), "--etcd-peers", "--hosts", "*.kvpool-etcd"],
                   capture_output=True, check=True)
    rendered = subprocess.run(["kubectl", "kustomize", str(overlay)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    objects = [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]
    validate(objects)
    assert {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"} == {"kvpool"}
    secrets = {base_name(name, SECRET_KEYS): set(s["data"]) for name, s in named(objects, "Secret").items()}
    assert secrets == SECRET_KEYS
    check_references(objects, secrets)
    check_etcd_peer_tls(objects)
    check_network_policies(objects)
    node = named(objects, "StatefulSet")["kvpool-node"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in node["containers"][0]["env"]}
    assert env["KVPOOL_STORENODE_DRAM"] == "512MiB" and env["KVPOOL_STORENODE_NODE_ID"] == "$(POD_NAME)"
    assert next(v for v in node["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "640Mi"


# -- etcd's peer port and who may reach which pod


def pod_labels(objects) -> dict[str, dict]:
    """Each workload's pod labels, with what the base's kustomization adds to every object."""
    kustomization = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())
    [common] = kustomization["labels"]
    assert common["includeSelectors"]
    return {o["metadata"]["name"]: {**common["pairs"], **o["spec"]["template"]["metadata"]["labels"]}
            for o in objects if o["kind"] in WORKLOADS}


def selects(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels, matchExpressions with In) matching `labels`."""
    return selector.get("matchLabels", {}).items() <= labels.items() and all(
        labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []) if e["operator"] == "In")


def admitted(objects, target: dict, source: dict, port: str, same_namespace: bool = True) -> bool:
    """Whether the NetworkPolicies let a pod labelled `source` reach `port` (a port name) of a pod labelled
    `target` (a pod no policy selects takes everyone)."""
    policies = [p for p in objects if p["kind"] == "NetworkPolicy" and selects(p["spec"]["podSelector"], target)]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if port not in [p["port"] for p in rule.get("ports", [])]:
                continue
            for peer in rule["from"]:
                namespace_ok = same_namespace if "namespaceSelector" not in peer else peer["namespaceSelector"] == {}
                if namespace_ok and selects(peer.get("podSelector", {}), source):
                    return True
    return False


def check_etcd_peer_tls(objects) -> None:
    """etcd's members speak https on their peer port and take only a peer with a kvpool-etcd-peer certificate,
    a Secret no other pod mounts."""
    etcd = named(objects, "StatefulSet")["kvpool-etcd"]["spec"]["template"]["spec"]
    args = dict(a.split("=", 1) if "=" in a else (a, "") for a in etcd["containers"][0]["args"])
    assert "--peer-client-cert-auth" in args
    peer_urls = [args["--listen-peer-urls"], args["--initial-advertise-peer-urls"],
                 *(m.split("=", 1)[1] for m in args["--initial-cluster"].split(","))]
    assert len(peer_urls) == 5 and all(url.startswith("https://") for url in peer_urls), peer_urls
    mounts = {m["mountPath"]: m["name"] for m in etcd["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in etcd["volumes"]}
    for flag, name in (("--peer-trusted-ca-file", "ca.pem"), ("--peer-cert-file", "cert.pem"),
                       ("--peer-key-file", "key.pem")):
        directory, file = args[flag].rsplit("/", 1)
        assert file == name and base_name(volumes[mounts[directory]]["secret"]["secretName"],
                                          SECRET_KEYS) == "kvpool-etcd-peer", flag
    holders = {o["metadata"]["name"] for o in objects if o["kind"] in WORKLOADS
               for v in o["spec"]["template"]["spec"].get("volumes", [])
               if base_name(v.get("secret", {}).get("secretName", ""), SECRET_KEYS) == "kvpool-etcd-peer"}
    assert holders == {"kvpool-etcd"}


def check_network_policies(objects) -> None:
    pods = pod_labels(objects)
    etcd, master, node, job = pods["kvpool-etcd"], pods["kvpool-master"], pods["kvpool-node"], pods["kvpool-etcd-auth"]
    client = {"kvpool.io/client": "true", "app": "vllm"}
    stranger = {"app": "anything"}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    assert [admitted(objects, etcd, p, "client") for p in (master, node, job, etcd, client, stranger)] == \
        [True, True, True, False, False, False]
    assert [admitted(objects, etcd, p, "peer") for p in (etcd, master, node, client, stranger)] == \
        [True, False, False, False, False]
    assert [admitted(objects, node, p, "data") for p in (master, node, client, etcd, stranger)] == \
        [True, True, True, False, False]
    assert not admitted(objects, node, client, "data", same_namespace=False)
    for port in ("grpc", "control"):
        assert [admitted(objects, master, p, port) for p in (master, node, client, etcd, stranger)] == \
            [True, True, True, False, False]
    for target in (master, node):
        assert admitted(objects, target, prometheus, "metrics", same_namespace=False)
        assert not admitted(objects, target, client, "metrics")


def test_etcd_members_take_only_peers_with_their_own_certificate():
    check_etcd_peer_tls(base_objects())


def test_network_policies_let_only_the_clusters_pods_and_clients_in():
    check_network_policies(base_objects())
