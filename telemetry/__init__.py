"""telemetry: probes, fallback rules and the routing-table service (see docs/design.md)."""
