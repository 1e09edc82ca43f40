"""Connections to storage nodes (TCP, UCX message layout) and socket helpers."""
