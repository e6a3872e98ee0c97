"""The daemon: gRPC servers on Unix sockets, sessions, tenants, metrics, the `prefixd` command."""
