"""The control plane's side: the admin API, the replica set's sources, health checks, usage sinks."""
