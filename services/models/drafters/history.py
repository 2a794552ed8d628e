"""The fleet's history for suffix drafts: one suffix index per tenant over recently finished outputs.

Every drafting process (a draft worker, a verify worker drafting for its own sessions, an in-process session)
keeps one `History`. It learns finished outputs from the fleet through a capped Redis stream that verify
workers append to (services/history_feed.py) or, in one process, from the sessions it ran. A tenant is an API
key, or a key's cache_salt (SessionSpec.tenant): a session drafts only from its own tenant's index, so how fast
a draft comes cannot tell one tenant another's text. The operator can pool every tenant into one index
(`suffix.share_across_tenants`).

Memory: at most `max_tenants` indexes of `capacity` tokens each, fixed at creation (services/models/drafters/
suffix_index.py), the least recently used tenant's index dropped for a new one. `memory_bytes` is that bound as
held now; /metrics and heartbeats show it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence

from services.models.drafters.suffix_index import SuffixDraft, SuffixIndex

logger = logging.getLogger(__name__)

SHARED_TENANT = "*"  # the one index of every tenant, when the operator pools them


class History:
    def __init__(self, *, capacity: int = 1 << 20, max_tenants: int = 8, share_across_tenants: bool = False,
                 key_lengths: Sequence[int] = (8, 4, 2), max_depth: int = 32, max_candidates: int = 32,
                 prompt_tail_tokens: int = 16) -> None:
        """capacity: tokens per tenant's index; prompt_tail_tokens: how much of a finished request's prompt is
        indexed before its output (the chat template's last tokens, so that an answer's opening matches)."""
        self.capacity = capacity
        self.max_tenants = max_tenants
        self.share_across_tenants = share_across_tenants
        self.prompt_tail_tokens = prompt_tail_tokens
        self._index_options = {"key_lengths": tuple(key_lengths), "max_depth": max_depth,
                               "max_candidates": max_candidates}
        self._indexes: OrderedDict[str, SuffixIndex] = OrderedDict()
        self._lock = threading.Lock()  # sessions draft on one thread, the feed adds on another
        self.num_added = 0  # outputs indexed since start
        self.num_evicted_tenants = 0

    def _tenant(self, tenant: str) -> str:
        return SHARED_TENANT if self.share_across_tenants else tenant

    def add(self, tenant: str, prompt_tail: Sequence[int], output_ids: Sequence[int]) -> None:
        """Index one finished output (with the last prompt tokens before it) under its tenant."""
        if not output_ids:
            return
        key = self._tenant(tenant)
        with self._lock:
            index = self._indexes.get(key)
            if index is None:
                if len(self._indexes) >= self.max_tenants:
                    evicted, _ = self._indexes.popitem(last=False)
                    self.num_evicted_tenants += 1
                    logger.info("suffix history: tenant %r's index dropped for a new tenant", evicted)
                index = SuffixIndex(self.capacity, **self._index_options)
                self._indexes[key] = index
            self._indexes.move_to_end(key)
            tail = list(prompt_tail)[-self.prompt_tail_tokens:] if self.prompt_tail_tokens else []
            index.add_document([*tail, *output_ids])
            self.num_added += 1

    def speculate(self, tenant: str, context: Sequence[int], max_tokens: int, **options) -> SuffixDraft:
        with self._lock:
            index = self._indexes.get(self._tenant(tenant))
            if index is None:
                return SuffixDraft()
            return index.speculate(context, max_tokens, **options)

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return sum(index.num_tokens for index in self._indexes.values())

    @property
    def memory_bytes(self) -> int:
        with self._lock:
            return sum(index.memory_bytes for index in self._indexes.values())

    @property
    def num_tenants(self) -> int:
        return len(self._indexes)

    def figures(self) -> dict[str, int]:
        """For heartbeats and /metrics: tokens and bytes held (the bound as it stands), tenants, outputs added."""
        return {"tokens": self.num_tokens, "bytes": self.memory_bytes, "tenants": self.num_tenants,
                "outputs": self.num_added}
