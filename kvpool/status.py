"""`kvpool status`: the master's Stats reply as a table."""

from .proto import kvpool_pb2
from .units import format_size


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def render_status(stats) -> str:
    rows = [["NODE", "ADDRESS", "TIER", "CAPACITY", "USED", "USED%", "OBJECTS", "TRANSPORTS"]]
    for node in sorted(stats.nodes, key=lambda n: n.node_id):
        for tier in node.tiers:
            share = 100.0 * tier.used / tier.capacity if tier.capacity else 0.0
            rows.append([node.node_id, node.address, kvpool_pb2.Tier.Name(tier.tier), format_size(tier.capacity),
                         format_size(tier.used), f"{share:.1f}", str(tier.objects), ",".join(node.transports)])
    lookups = stats.hits + stats.misses
    hit_rate = f"{100.0 * stats.hits / lookups:.1f}%" if lookups else "-"
    summary = (f"master {stats.address} ({stats.master_id}): {len(stats.nodes)} nodes, {stats.objects} objects, "
               f"{format_size(stats.bytes)} stored, {stats.pending_puts} puts in progress\n"
               f"puts {stats.puts}, removes {stats.removes}, reclaimed puts {stats.reclaimed_puts}, "
               f"lookups: {stats.hits} hits, {stats.misses} misses (hit rate {hit_rate})")
    return summary + "\n\n" + _table(rows)
