"""The gateway's text deltas, decoded a window at a time, against decoding the whole output at every token: the
same deltas at every step on the built-in tokenizer, for multi-byte characters, special tokens, random ids and
stop strings, whatever the events' sizes."""

from __future__ import annotations

import random

import pytest

from gateway.streams.text import IncrementalText
from services.config import get_settings
from services.models.locate import resolve_model_dir
from services.models.tokenizer_loading import load_tokenizer

TEXTS = [
    "Plain English, with punctuation: commas, dots... and 'quotes'.",
    "Émigrés naïvely café-hopping; Ærø's fjords — déjà vu!",
    "混合中文和日本語のテキスト, 한국어도 조금.",
    "Emoji 🤖🚀👍🏽 and a family 👨‍👩‍👧 inside a sentence.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n\n\tindented\r\n",
    "  leading spaces, trailing spaces   ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir("smollm2-135m", get_settings().cache_dir)[1])


class WholeText:
    """The reference: the whole output decoded at every feed."""

    def __init__(self, tokenizer, stop):
        self.reference = IncrementalText(tokenizer, stop)

    def feed(self, token_ids):
        reference = self.reference
        reference.token_ids.extend(token_ids)
        text = reference.text()
        safe = text[: len(text) - reference._holdback] if reference._holdback else text
        safe = safe.rstrip("\ufffd")
        if len(safe) <= len(reference.sent) or not safe.startswith(reference.sent):
            return ""
        delta, reference.sent = safe[len(reference.sent):], safe
        return delta


def _chunks(token_ids, rng):
    index = 0
    while index < len(token_ids):
        size = rng.choice([1, 1, 1, 2, 3, 7])
        yield token_ids[index:index + size]
        index += size


def _same_deltas(tokenizer, token_ids, stop, seed):
    rng = random.Random(seed)
    window, whole = IncrementalText(tokenizer, stop), WholeText(tokenizer, stop)
    for chunk in _chunks(token_ids, rng):
        assert window.feed(chunk) == whole.feed(chunk)
    assert window.sent + window.finish() == whole.reference.text()


@pytest.mark.parametrize("stop", [[], ["; Ærø", "\n\n"], ["👍"]])
def test_window_deltas_are_the_whole_decodings_deltas_on_real_text(tokenizer, stop):
    for seed, text in enumerate(TEXTS):
        _same_deltas(tokenizer, tokenizer.encode(text), stop, seed)
    _same_deltas(tokenizer, tokenizer.encode(" ".join(TEXTS * 4)), stop, 99)


def test_window_deltas_are_the_whole_decodings_deltas_on_random_and_special_ids(tokenizer):
    rng = random.Random(7)
    special = list(tokenizer.all_special_ids)
    for seed in range(20):
        token_ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
                     for _ in range(rng.randrange(1, 120))]
        _same_deltas(tokenizer, token_ids, ["ing"] if seed % 2 else [], seed)


def test_a_long_output_decodes_a_window_per_feed_not_the_whole_output(tokenizer):
    calls = []

    class Counting:
        def decode(self, token_ids, **options):
            calls.append(len(token_ids))
            return tokenizer.decode(token_ids, **options)

    text = IncrementalText(Counting(), [])
    for token_id in tokenizer.encode(" ".join(TEXTS * 8)):
        text.feed([token_id])
    assert len(text.token_ids) > 500 and max(calls) <= 2 * IncrementalText.CONTEXT_TOKENS
