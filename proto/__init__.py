"""Protobuf contracts of the control plane (generated code committed beside kvpool.proto)."""
