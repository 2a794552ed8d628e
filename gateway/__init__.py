"""Gateway: the OpenAI-compatible HTTP front of the fleet. One process (or several behind one port) per host.

Rooms, from the door inwards (a room imports only rooms below it in this list, and `state`):
- `api/`: the HTTP surface: generation endpoints (one body or SSE), models, health, request status and
  cancellation, metrics, the dashboard and its static page;
- `sessions/`: a request's session: submission (checks, SQL row, Redis spec, the start), single-flight
  sharing, recovery of a stalled session, the end of an answer;
- `admission/`: who gets in and when: API keys and priority tiers, in-flight slots and the wait queue (one
  gateway's, or counted in Redis for several), the front door that refuses before any request work, turns;
- `streams/`: reading a session's output stream into token events and text deltas, counted once;
- `fleet/`: the gateway's view of the fleet: live workers, the routing table, similarity routing;
- `observability/`: Prometheus metrics, the live figures of the dashboard, the access log.
Beside the rooms: `app.py` builds the application, `state.py` holds what the process holds, `errors.py` and
`schemas.py` are the OpenAI error and request shapes every room speaks, `drain.py` the graceful stop.
"""
