"""Per-request target state on a verify worker, and the LRU cache that bounds its KV memory."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from services.engine.stopping import OutputState
from services.engine.target import TargetSession
from services.models.loading import LoadedModel
from services.protocol import OutputEvent, SessionSpec
from services.speculative.sampling import SamplingParams
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


def kv_bytes_per_token(target: LoadedModel) -> int:
    """2 (keys, values) x layers x kv heads x head dim x bytes per element."""
    config = target.config
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    element_size = 2 if target.precision in ("bf16", "fp16") else 4
    return 2 * config.num_hidden_layers * num_kv_heads * head_dim * element_size


@dataclass
class VerifySession:
    spec: SessionSpec
    target_session: TargetSession
    output: OutputState
    sampling: SamplingParams
    generator: torch.Generator
    seq: int  # output events committed so far = the next round's number
    stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)
    last_used: float = field(default_factory=time.monotonic)

    @property
    def num_committed(self) -> int:
        return len(self.target_session.token_ids)


def build_session(target: LoadedModel, spec: SessionSpec, events: list[OutputEvent], chunk_size: int) -> VerifySession:
    """A session from the request spec and the committed output so far (a new one, or a rebuild)."""
    output_ids = [token_id for event in events for token_id in event.token_ids]
    sampling = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed)
    output = OutputState(
        tokenizer=target.tokenizer,
        eos_token_ids=frozenset() if spec.ignore_eos else target.eos_token_ids,
        max_new_tokens=spec.max_new_tokens,
        stop=spec.stop,
        output_ids=output_ids,
    )
    session = VerifySession(
        spec=spec,
        target_session=TargetSession(target, [*spec.prompt_ids, *output_ids], chunk_size=chunk_size),
        output=output,
        sampling=sampling,
        generator=sampling.make_stream("target", len(events), device=target.device),
        seq=len(events),
    )
    if events:
        last = events[-1]
        session.stats.num_drafts = last.num_drafts
        session.stats.num_draft_tokens = last.num_draft_tokens
        session.stats.num_accepted_tokens = last.num_accepted_tokens
        session.stats.num_draft_tokens_per_pos = list(last.num_draft_tokens_per_pos)
        session.stats.num_accepted_tokens_per_pos = list(last.num_accepted_tokens_per_pos)
    return session


class SessionCache:
    """LRU over sessions, evicting the least recently used past a KV-cache byte budget.

    An evicted session is rebuilt from its committed prefix on its next block.
    """

    def __init__(self, *, bytes_per_token: int, budget_bytes: int) -> None:
        self.bytes_per_token = bytes_per_token
        self.budget_bytes = budget_bytes
        self._sessions: OrderedDict[str, VerifySession] = OrderedDict()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sessions

    @property
    def kv_bytes(self) -> int:
        return sum(s.target_session.num_cached * self.bytes_per_token for s in self._sessions.values())

    def get(self, request_id: str) -> VerifySession | None:
        session = self._sessions.get(request_id)
        if session is not None:
            self._sessions.move_to_end(request_id)
            session.last_used = time.monotonic()
        return session

    def put(self, request_id: str, session: VerifySession) -> None:
        self._sessions[request_id] = session
        self._sessions.move_to_end(request_id)
        self.evict_over_budget(keep=request_id)

    def evict_over_budget(self, keep: str | None = None) -> None:
        while self.kv_bytes > self.budget_bytes and len(self._sessions) > 1:
            victim = next(iter(self._sessions))
            if victim == keep:
                break
            self.pop(victim)
            self.num_evictions += 1
            logger.info("evicted session %s (KV budget %d bytes)", victim, self.budget_bytes)

    def pop(self, request_id: str) -> VerifySession | None:
        session = self._sessions.pop(request_id, None)
        if session is not None:
            session.target_session.release()
        return session
