"""kvpubd: a KV-cache sidecar that publishes its cache events over ZeroMQ, resets at once."""

__version__ = "0.1.0"
