"""Similarity routing: recent prompts in a MinHash LSH index (datasketch), so that a request much like a recent
one goes to the verify worker that holds that one's KV (its prefix is then copied there, not prefilled).

A prompt's sketch is the MinHash of its token shingles (`shingle_tokens` consecutive ids). The index keeps
the last `index_size` prompts, and learns which verify worker holds each from the first output event
(OutputEvent.worker_id). Whether the worker may take the request (alive, not hot, in a pool the routing table
gives traffic) is the router's call (gateway/fleet/routing.py `affinity_route`), not the index's.
"""

from __future__ import annotations

import logging
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from datasketch import MinHash, MinHashLSH

from services.config import MergingSettings

logger = logging.getLogger(__name__)


def shingles(token_ids: Sequence[int], size: int) -> list[bytes]:
    """The prompt's overlapping runs of `size` tokens, as bytes (a prompt shorter than that is one shingle)."""
    size = max(1, min(size, len(token_ids)))
    packed = struct.pack(f"<{len(token_ids)}i", *token_ids)
    width = 4 * size
    return [packed[4 * start : 4 * start + width] for start in range(len(token_ids) - size + 1)]


@dataclass
class Similar:
    request_id: str
    similarity: float  # estimated Jaccard similarity of the two prompts' shingles
    worker_id: str  # the verify worker that holds its KV


@dataclass
class _Entry:
    sketch: MinHash
    salt: str | None = None
    worker_id: str = ""


class SimilarityIndex:
    def __init__(self, settings: MergingSettings) -> None:
        self.threshold = settings.similarity_threshold
        self.num_perm = settings.minhash_permutations
        self.shingle_tokens = settings.shingle_tokens
        self.size = settings.index_size
        self._lsh = MinHashLSH(threshold=self.threshold, num_perm=self.num_perm)
        template = MinHash(num_perm=self.num_perm)
        self._permutations, self._scheme = template.permutations, template.scheme  # drawn once, not per sketch
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def sketch(self, token_ids: Sequence[int]) -> MinHash:
        sketch = MinHash(num_perm=self.num_perm, permutations=self._permutations, scheme=self._scheme)
        sketch.update_batch(shingles(token_ids, self.shingle_tokens))
        return sketch

    def sketch_of(self, hashvalues) -> MinHash:
        """A sketch from its hash values (another gateway's, gateway/fleet/similarity_log.py)."""
        return MinHash(num_perm=self.num_perm, hashvalues=hashvalues, permutations=self._permutations,
                       scheme=self._scheme)

    def most_similar(self, sketch: MinHash, *, salt: str | None = None) -> list[Similar]:
        """Recent prompts of the same cache salt, at least `threshold` similar, whose verify worker is known,
        most similar first."""
        found = []
        for request_id in self._lsh.query(sketch):
            entry = self._entries.get(request_id)
            if entry is None or not entry.worker_id or entry.salt != salt:
                continue
            similarity = sketch.jaccard(entry.sketch)
            if similarity >= self.threshold:
                found.append(Similar(request_id, similarity, entry.worker_id))
        found.sort(key=lambda item: item.similarity, reverse=True)
        return found

    def add(self, request_id: str, sketch: MinHash, salt: str | None = None) -> None:
        if request_id in self._entries:
            return
        self._lsh.insert(request_id, sketch)
        self._entries[request_id] = _Entry(sketch, salt)
        while len(self._entries) > self.size:
            oldest, _ = self._entries.popitem(last=False)
            self._lsh.remove(oldest)

    def note_worker(self, request_id: str, worker_id: str) -> bool:
        """The verify worker that committed the request's latest round (where its KV is now). True when that
        is news."""
        entry = self._entries.get(request_id)
        if entry is not None and worker_id and entry.worker_id != worker_id:
            entry.worker_id = worker_id
            self._entries.move_to_end(request_id)  # in use: the last to be forgotten
            return True
        return False
