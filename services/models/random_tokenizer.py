"""The tokenizer of a random-weight target (`random:<shape>`): byte-level, built in code, any vocabulary size.

A random target has no tokenizer of its own, and the built-in one (49,152 ids) fits neither the tiny shape
(512) nor Llama's (128,256). This one encodes text as its UTF-8 bytes (ids 3..258, no merges) and decodes
every other id as the word ` t<id>`, so whatever a random model generates shows as text (a stream's first
chunk is never empty). Ids 0, 1, 2 are `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (the end of a turn and
of generation, as LlamaConfig's default eos_token_id 2), with a ChatML template, so chat requests work.
Deterministic: every process builds the same ids for the same size."""

from __future__ import annotations

import logging
from functools import lru_cache

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
NUM_BYTE_TOKENS = 256
MIN_VOCAB = len(SPECIAL_TOKENS) + NUM_BYTE_TOKENS
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@lru_cache(maxsize=4)
def random_tokenizer(vocab_size: int):
    """A transformers fast tokenizer of exactly vocab_size ids (~0.5 s for 128k; cached per size)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB:
        raise ValueError(f"a random target's vocabulary needs at least {MIN_VOCAB} ids, got {vocab_size}")
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    for index in range(len(vocab), vocab_size):
        vocab[f"\u0120t{index}"] = index  # "\u0120" is a space in the byte-level alphabet
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS_TOKEN, pad_token=SPECIAL_TOKENS[0],
                                        additional_special_tokens=[SPECIAL_TOKENS[1]])
    tokenizer.chat_template = CHAT_TEMPLATE
    assert len(tokenizer) == vocab_size, f"{len(tokenizer)} ids, expected {vocab_size}"
    return tokenizer
