"""Usage exporters: one `UsageSink` per module (latest copy, Prometheus, HTTP push)."""
