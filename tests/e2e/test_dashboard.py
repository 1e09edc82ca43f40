"""The Grafana dashboard asks only for metrics a real running cluster exports, and every query of every panel
shows data when a real Prometheus scrapes that cluster."""

import json
import os
import re
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_check import (MISSING, PROMETHEUS, Prometheus, check_dashboard, dashboard_queries, fill_variables,
                              panels)

from kvpool import Client
from kvpool.errors import ForbiddenError
from kvpool.net.netutil import wait_until

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvpool.json"


def queried_metrics() -> set[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)) and dashboard["uid"]
    exprs = [expr for _title, _ref, expr in dashboard_queries(DASHBOARD)]
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


def drive(cluster, round: str = "") -> None:
    """Traffic that moves every panel: puts, reads (cached and not), a miss, a remove, a node refusing a
    stale cached placement (an error), and a call with a wrong credential refused. Keys of each `round` are
    its own."""
    token = cluster.client_token
    keys = [f"d{round}/{i}" for i in range(20)]
    with Client(cluster.master_address, token=token) as writer, Client(cluster.master_address, token=token) as other:
        writer.batch_put(keys, [b"v" * 5000] * 20)
        assert writer.batch_get(keys) == [b"v" * 5000] * 20
        assert writer.get(keys[0]) == b"v" * 5000  # its placement is cached now
        assert other.exists("missing") is False
        other.remove(keys[0])

        def stale_read_refused() -> bool:  # the node refuses the cached placement of a freed object
            try:
                writer.get(keys[0])
            except KeyError:
                pass
            return "kvpool_node_errors_total" in exported(cluster.metrics_urls.values())

        wait_until(stale_read_refused, 20, what="a node to count an error")
    with Client(cluster.master_address, token="kvpool-not-this-cluster") as stranger:
        with pytest.raises(ForbiddenError):
            stranger.put(keys[0], b"v")


def test_every_metric_the_dashboard_queries_is_exported(own_cluster):
    cluster = own_cluster(2, metrics=True)
    drive(cluster)
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


KiB, MiB = 1 << 10, 1 << 20
BLOCK = 512 * KiB


def cycle_tiers(cluster, round: str) -> None:
    """Blocks past the nodes' DRAM high watermark (demotions to SSD) and, over two rounds, past DRAM and SSD
    together (evictions), each read twice by clients that ask the master (lookup hits; an SSD block read
    twice is promoted)."""
    keys = [f"t{round}/{i}" for i in range(24)]  # 12 MiB a round into 2 x (4 MiB DRAM + 8 MiB SSD)
    with Client(cluster.master_address, token=cluster.client_token) as writer:
        for key in keys:
            writer.put(key, os.urandom(BLOCK))
    for _ in range(2):
        with Client(cluster.master_address, token=cluster.client_token) as reader:  # an empty placement cache
            values = reader.batch_get(keys)
            assert {len(value) for value in values if value is not None} == {BLOCK}  # (None: evicted already)

MOVED = ("kvpool_node_tier_evictions_total", "kvpool_node_tier_demotions_total", "kvpool_node_tier_promotions_total",
         "kvpool_node_errors_total", "kvpool_master_lookup_hits_total", "kvpool_master_lookup_misses_total",
         "kvpool_master_grpc_unauthenticated_total")


@pytest.mark.skipif(PROMETHEUS is None, reason=MISSING)
def test_every_dashboard_query_shows_data_in_a_real_prometheus(own_cluster, tmp_path):
    cluster = own_cluster(2, metrics=True, dram_per_node="4MiB", ssd_per_node="8MiB",
                          node_args=["--high-watermark", "0.5", "--low-watermark", "0.25"])
    with Prometheus(cluster.metrics_urls, tmp_path / "prometheus") as prometheus:
        # rate() counts only what a series gained between two samples, and a series appears with the
        # traffic that makes it: traffic before and after one scrape, then two scrapes to read it all.
        for round in ("a", "b"):
            drive(cluster, round)
            cycle_tiers(cluster, round)
            prometheus.wait_scraped(scrapes=1 if round == "a" else 2)
        failures = check_dashboard(DASHBOARD, prometheus.url)
        # The check itself: a copy of the dashboard with one metric misnamed fails on that query alone.
        broken = json.loads(DASHBOARD.read_text())
        target = next(panel for panel in panels(broken) if panel.get("targets"))["targets"][0]
        target["expr"] = target["expr"].replace("kvpool_", "kvpool_misnamed_", 1)
        (tmp_path / "broken.json").write_text(json.dumps(broken))
        caught = check_dashboard(tmp_path / "broken.json", prometheus.url)
        # What the panels show moved with the traffic: not just series at 0.
        moved = {counter: prometheus.values(f"sum(increase({counter}[5m]))") for counter in MOVED}
    assert not failures, "dashboard queries that show nothing:\n" + "\n".join(failures)
    assert all(values[0] > 0 for values in moved.values()), f"counters the traffic did not move: {moved}"
    assert len(caught) == 1 and "kvpool_misnamed_" in caught[0] and caught[0].endswith("no data"), caught


def test_panels_in_rows_are_checked_and_every_grafana_variable_is_filled_or_named(tmp_path):
    dashboard = {"panels": [{"title": "top", "targets": [{"refId": "A", "expr": "up"}]},
                            {"type": "row", "title": "tenants", "collapsed": True, "panels": [
                                {"title": "inside", "targets": [{"refId": "B", "expr": "x{tenant=\"$tenant\"}"}]}]}]}
    (tmp_path / "d.json").write_text(json.dumps(dashboard))
    assert dashboard_queries(tmp_path / "d.json") == [("top", "A", "up"), ("inside", "B", 'x{tenant="$tenant"}')]
    assert fill_variables('rate(m{node="$node",t=~"${tenant:regex}"}[$__rate_interval]) [[node]]',
                          {"node": "node-0", "tenant": "b"}) == 'rate(m{node="node-0",t=~"b"}[1m]) node-0'
    with pytest.raises(KeyError, match=r"\$tenant"):
        fill_variables('x{tenant="$tenant"}', {})
