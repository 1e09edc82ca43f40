"""The Grafana dashboard asks only for metrics a real running cluster exports."""

import json
import re
import urllib.request
from pathlib import Path

import yaml

from kvpool import Client
from kvpool.net.netutil import wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpool.json"


def queried_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"]
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert exprs and all(exprs)
    return {name for expr in exprs for name in re.findall(r"\bkvpool_[a-z0-9_]+", expr)}


def exported(urls) -> set[str]:
    names = set()
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as answer:
            for line in answer.read().decode().splitlines():
                if line and not line.startswith("#"):
                    names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_every_metric_the_dashboard_queries_is_exported(own_cluster):
    cluster = own_cluster(2, metrics=True)
    token = cluster.client_token
    with Client(cluster.master_address, token=token) as writer, Client(cluster.master_address, token=token) as other:
        writer.batch_put([f"d{i}" for i in range(20)], [b"v" * 5000] * 20)
        assert writer.batch_get([f"d{i}" for i in range(20)]) == [b"v" * 5000] * 20
        assert writer.get("d0") == b"v" * 5000  # its placement is cached now
        assert other.exists("missing") is False
        other.remove("d0")

        def stale_read_refused() -> bool:  # the node refuses the cached placement of a freed object
            try:
                writer.get("d0")
            except KeyError:
                pass
            return "kvpool_node_errors_total" in exported(cluster.metrics_urls.values())

        wait_until(stale_read_refused, 20, what="a node to count an error")
    have = exported(cluster.metrics_urls.values())
    missing = sorted(name for name in queried_metrics() if name not in have)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"


def test_prometheus_config_scrapes_kvpool_pods_and_compose_services():
    config = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for group in jobs["kvpool-compose"]["static_configs"]:
        for target in group["targets"]:
            host, port = target.split(":")
            assert host in compose and "--metrics-port" in compose[host]["command"]
            assert compose[host]["command"][compose[host]["command"].index("--metrics-port") + 1] == port
    assert jobs["kvpool-kubernetes"]["kubernetes_sd_configs"] == [{"role": "pod"}]
