"""`kvpool status`: the master's Stats reply as a table, one row per tier of each node."""

from collections import Counter

from ..proto import kvpool_pb2
from ..protocol.units import format_size

_COLUMNS = ["NODE", "ADDRESS", "TIER", "CAPACITY", "USED", "USED%", "OBJECTS", "HITS", "MISSES",
            "DEMOTED", "PROMOTED", "EVICTED", "WATERMARK", "TRANSPORTS"]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def _tier_row(node, tier) -> list[str]:
    share = 100.0 * tier.used / tier.capacity if tier.capacity else 0.0
    name = node.node_id + (f"@{node.zone}" if node.zone else "") + (" (draining)" if node.draining else "")
    return [name, node.address, kvpool_pb2.Tier.Name(tier.tier), format_size(tier.capacity),
            format_size(tier.used), f"{share:.1f}", str(tier.objects), str(tier.hits), str(tier.misses),
            str(tier.demotions), str(tier.promotions), str(tier.evictions), tier.watermark or "-",
            ",".join(node.transports)]


def _versions(stats) -> str:
    """The releases the cluster runs: a rolling upgrade shows as nodes of two."""
    counts = Counter(node.version or "unknown" for node in stats.nodes)
    nodes = ", ".join(f"{version} on {count}" for version, count in sorted(counts.items()))
    return (f"releases: master {stats.version or 'unknown'} (wire protocol {stats.wire_protocol or '?'}); "
            f"nodes {nodes or 'none'}")


def _faults(stats) -> str:
    """A line per tier a node skips because its disk or mount fails."""
    lines = []
    for node in sorted(stats.nodes, key=lambda n: n.node_id):
        for tier in sorted(node.tiers, key=lambda t: t.tier):
            if tier.fault:
                lines.append(f"{node.node_id} {kvpool_pb2.Tier.Name(tier.tier)} fails, skipped until it answers: "
                             f"{tier.fault}")
    for node in sorted(stats.nodes, key=lambda n: n.node_id):
        if node.shared_fault:
            lines.append(f"{node.node_id} shared tier fails, skipped until it answers: {node.shared_fault}")
    return "".join("\n" + line for line in lines)


def render_status(stats) -> str:
    rows = [list(_COLUMNS)]
    for node in sorted(stats.nodes, key=lambda n: n.node_id):
        # DRAM first, then SSD, whatever order the master listed them in.
        for tier in sorted(node.tiers, key=lambda t: t.tier):
            rows.append(_tier_row(node, tier))
    lookups = stats.hits + stats.misses
    hit_rate = f"{100.0 * stats.hits / lookups:.1f}%" if lookups else "-"
    summary = (f"master {stats.address} ({stats.master_id}): {len(stats.nodes)} nodes, {stats.objects} objects, "
               f"{format_size(stats.bytes)} stored, {stats.pending_puts} puts in progress; "
               f"leader {stats.leader or 'none elected'} (term {stats.term}), "
               f"followers: {', '.join(stats.followers) or 'none'}\n"
               f"puts {stats.puts}, removes {stats.removes}, reclaimed puts {stats.reclaimed_puts}, "
               f"lookups: {stats.hits} hits, {stats.misses} misses (hit rate {hit_rate})\n"
               f"replica health: {stats.under_replicated} objects below their copy target; "
               f"repairs done {stats.repairs_done} ({format_size(stats.repair_bytes)})")
    summary += "\n" + _versions(stats) + _faults(stats)
    if stats.HasField("shared"):
        shared = stats.shared
        share = 100.0 * shared.used / shared.capacity if shared.capacity else 0.0
        summary += (f"\nshared tier: {shared.objects} objects, {format_size(shared.used)} of "
                    f"{format_size(shared.capacity)} ({share:.1f}%), served by {shared.servers} nodes")
    text = summary + "\n\n" + _table(rows)
    if stats.tenants:
        from .tenant import render_tenants

        text += "\n\n" + render_tenants(stats.tenants)
    return text
