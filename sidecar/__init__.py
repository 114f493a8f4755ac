"""The vcap sidecar: attaches to the engine's segment, serves the gRPC control API, renews the
lease, reads the telemetry rings and exports Prometheus metrics. Never imports torch."""

__all__: list[str] = []
