"""verify_worker: see README and ../shared/DESIGN.md; filled in by the distributed-suite issue."""
