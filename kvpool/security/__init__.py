"""Who may talk to whom: the cluster secret and credentials, gRPC call proofs, TLS material and TLS sockets."""
