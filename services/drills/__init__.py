"""Operator drills against a running stack, beside the bench: what an operator does to a fleet, and what it
does back. `chaos` (kill -9s of workers, a Redis restart or a Sentinel failover, under load, checked against
target-only), `burst` (N requests at once: only 200, 503 or 429 with Retry-After) and `thermal` (a probe
override heats a GPU worker: the routing table moves its pool's share, then back). The CLI is
`mirror-sd drill chaos|burst` and `mirror-sd telemetry drill`.
"""
