"""A delayed network link for the testbed, and what draft workers measure of theirs.

`mirror-sd up --draft-link RTT_MS[:JITTER_MS]` puts the draft workers behind
a small TCP proxy in front of Redis (`proxy.py`) that holds every chunk for
RTT/2 in each direction, plus a random 0..JITTER/2 that never reorders a
stream: drafts at the edge, on one box, with no netem. `mirror-sd link` runs
the proxy alone for any process. Its setting can be changed while it runs
through Redis (`control.py`), which is how `mirror-sd bench --draft-link
0,20,50` tries each level on one stack. `meter.py` holds the figures a draft
worker reports of its link: Redis RTT, round trip of its rounds, transport.
"""
