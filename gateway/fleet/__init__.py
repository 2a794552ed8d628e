"""The gateway's view of the fleet, read from Redis and cached briefly: live workers from their heartbeats, the
telemetry service's routing table, and the similarity index that sends a request where a similar one ran."""
