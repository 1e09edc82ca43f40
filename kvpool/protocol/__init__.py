"""What the components agree on, with no I/O: data and control frames, write options, inventory records, keys,
sizes, checksums, multi-part values, transport names, the etcd layout."""
