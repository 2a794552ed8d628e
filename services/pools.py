"""Verify pools of a local stack (`mirror-sd up --verify-pools accel=1,cpu=1 --accelerator-pools accel`).

One machine can stand in for a heterogeneous fleet: each pool entry starts that many
verify workers, and a pool declared an accelerator reports device kind
`accelerator` in its heartbeats, so the thermal rule treats it as one in a drill.
Traffic leaves a hot accelerator for the telemetry fallback pool, which is why
the stack needs at least one pool that is not an accelerator.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

POOL_NAME = re.compile(r"^[a-z0-9_-]+$")  # WorkerSettings.pool's pattern
DECLARED_KIND = "accelerator"
ACCELERATORS = ("cuda", "gpu", "accelerator")  # device kinds the thermal rule watches (GPU temperatures)
MAX_WORKERS_PER_POOL = 16


@dataclass(frozen=True)
class VerifyPool:
    name: str
    count: int
    accelerator: bool = False

    def worker_ids(self) -> list[str]:
        return [f"verify-{self.name}-{index}" for index in range(self.count)]


def _pool_name(name: str, text: str, option: str) -> str:
    if not POOL_NAME.match(name):
        raise ValueError(f"{option}: pool name must be lowercase letters, digits, '-' or '_', got {name!r} "
                         f"in {text!r}")
    return name


def parse_verify_pools(text: str, accelerators: str | None = None) -> list[VerifyPool]:
    """'accel=1,cpu=1' -> pools in the order given; a bad entry raises ValueError naming it."""
    pools: dict[str, int] = {}
    for entry in (part.strip() for part in text.split(",")):
        name, sep, count_text = entry.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--verify-pools: expected name=count entries like accel=1,cpu=1, got {entry!r} "
                             f"in {text!r}")
        name = _pool_name(name.strip(), text, "--verify-pools")
        try:
            count = int(count_text)
        except ValueError:
            raise ValueError(f"--verify-pools: worker count of pool {name!r} must be an integer, got "
                             f"{count_text.strip()!r}") from None
        if not 1 <= count <= MAX_WORKERS_PER_POOL:
            raise ValueError(f"--verify-pools: worker count of pool {name!r} must be 1..{MAX_WORKERS_PER_POOL}, "
                             f"got {count}")
        if name in pools:
            raise ValueError(f"--verify-pools: pool {name!r} is named twice in {text!r}")
        pools[name] = count
    declared = set()
    for name in (part.strip() for part in (accelerators or "").split(",")):
        if not name:
            continue
        if name not in pools:
            raise ValueError(f"--accelerator-pools: {name!r} is not one of the verify pools {sorted(pools)}")
        declared.add(_pool_name(name, accelerators, "--accelerator-pools"))
    return [VerifyPool(name, count, name in declared) for name, count in pools.items()]


def fallback_pool(pools: list[VerifyPool], configured: str) -> str:
    """Where a hot accelerator's traffic goes: the configured pool when it is a non-accelerator pool of the
    stack, else the first such pool. With every pool an accelerator there is nowhere to go."""
    plain = [pool.name for pool in pools if not pool.accelerator]
    if not plain:
        raise ValueError("--accelerator-pools: every verify pool is declared an accelerator; keep one plain pool "
                         "(e.g. cpu=1) for the thermal rule to move traffic to")
    return configured if configured in plain else plain[0]
