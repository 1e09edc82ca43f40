"""Starting processes: a whole cluster on one machine, a real etcd."""
