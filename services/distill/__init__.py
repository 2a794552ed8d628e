"""`mirror-sd distill`: train a small draft on text the target itself generates."""
