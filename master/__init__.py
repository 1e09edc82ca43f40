"""Master: the control plane (object table, placement, membership) served over gRPC."""
