"""Reading a session's output stream: token events in order, once each (across Redis outages and failovers),
turned into text deltas. The reader reports a stall to whoever reads; it does not act on it (sessions/)."""
