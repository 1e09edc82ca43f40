"""The etcd client every component shares."""
