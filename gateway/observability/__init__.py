"""What the gateway tells operators: Prometheus metrics, the dashboard's live figures, the access log."""
