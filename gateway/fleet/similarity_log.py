"""Similarity routing across several gateways: one index, kept by every gateway from a log in Redis.

Each gateway's SimilarityIndex (gateway/fleet/similarity.py) is in its memory. With several gateways, each also
appends to one capped stream what it adds to its index (a new session's prompt sketch and cache salt) and what it
learns (the verify worker holding a session's KV), and tails that stream into its own index. A request reaching
gateway B then finds a similar one started on gateway A as A would, a few milliseconds after A started it. A
gateway starting (or restarted) reads the log's last `index_size` entries first, so it knows the recent
prompts at once. Best effort: with Redis away a gateway routes on what its index holds.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import redis
import redis.asyncio as aioredis
from datasketch import MinHash

from gateway.fleet.similarity import SimilarityIndex
from services.protocol import SIMILARITY_LOG_KEY

logger = logging.getLogger(__name__)

BLOCK_MS = 1000
RETRY_S = 1.0


class SimilarityLog:
    def __init__(self, redis_client: aioredis.Redis, index: SimilarityIndex, gateway_id: str) -> None:
        self.redis = redis_client
        self.index = index
        self.gateway_id = gateway_id

    async def added(self, request_id: str, sketch: MinHash, salt: str | None) -> None:
        values = sketch.hashvalues
        await self._append({"op": "add", "id": request_id, "salt": salt if salt is not None else "",
                            "has_salt": "1" if salt is not None else "0", "dtype": values.dtype.str,
                            "hv": values.tobytes()})

    async def noted(self, request_id: str, worker_id: str) -> None:
        await self._append({"op": "worker", "id": request_id, "worker": worker_id})

    async def _append(self, fields: dict) -> None:
        try:
            await self.redis.xadd(SIMILARITY_LOG_KEY, {**fields, "gw": self.gateway_id}, maxlen=self.index.size,
                                  approximate=True)
        except (redis.RedisError, OSError) as exc:  # routing is a preference: the request goes on
            logger.warning("similarity log: could not append (%s)", exc)

    def apply(self, fields: dict[bytes, bytes]) -> None:
        """One entry of another gateway into this one's index."""
        if fields.get(b"gw", b"").decode() == self.gateway_id:
            return
        request_id, op = fields[b"id"].decode(), fields[b"op"]
        if op == b"add":
            values = np.frombuffer(fields[b"hv"], dtype=np.dtype(fields[b"dtype"].decode()))
            salt = fields[b"salt"].decode() if fields.get(b"has_salt") == b"1" else None
            self.index.add(request_id, self.index.sketch_of(values), salt)
        elif op == b"worker":
            self.index.note_worker(request_id, fields[b"worker"].decode())

    async def follow(self) -> None:
        """The log into this gateway's index, for as long as it serves (a task of its lifespan)."""
        last_id = None
        while True:
            try:
                if last_id is None:  # the recent past first, oldest first
                    recent = await self.redis.xrevrange(SIMILARITY_LOG_KEY, count=self.index.size)
                    for entry_id, fields in reversed(recent):
                        self._apply_quietly(fields)
                    last_id = recent[0][0] if recent else "0-0"
                response = await self.redis.xread({SIMILARITY_LOG_KEY: last_id}, block=BLOCK_MS)
                for _, entries in response or []:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        self._apply_quietly(fields)
            except (redis.RedisError, OSError) as exc:
                logger.warning("similarity log: cannot read (%s); again in %.0fs", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)

    def _apply_quietly(self, fields: dict[bytes, bytes]) -> None:
        try:
            self.apply(fields)
        except (KeyError, ValueError) as exc:
            logger.warning("similarity log: skipped an entry (%s: %s)", type(exc).__name__, exc)
