"""`random:<shape>[:<seed>]` targets: the spec, and the tokenizer built for them (no files, any vocabulary)."""

import pytest

from services.models.random_shapes import random_target_vocab
from services.models.random_spec import SHAPES, RandomSpec, parse_random_spec
from services.models.random_tokenizer import random_tokenizer
from services.models.tokenization import encode_messages


def test_parse_random_spec():
    assert parse_random_spec("random:tiny") == RandomSpec("tiny", 0)
    assert parse_random_spec("random:llama-1b:7") == RandomSpec("llama-1b", 7)
    assert parse_random_spec("random:tiny").name == "random-tiny"
    assert parse_random_spec("random:tiny:3").name == "random-tiny-seed3"


def test_the_random_tokenizer_round_trips_text_and_shows_every_id():
    tokenizer = random_tokenizer(SHAPES["tiny"]["vocab_size"])
    assert len(tokenizer) == 512 and tokenizer.eos_token_id == 2
    text = "Héllo, wörld! 1 + 1 = 2"
    ids = tokenizer.encode(text)
    assert max(ids) < 259 and tokenizer.decode(ids) == text
    assert tokenizer.decode([300, 511]) == " t300 t511"  # a random model's ids all show as text
    prompt = encode_messages(tokenizer, [{"role": "user", "content": "hi"}])
    assert prompt[0] == 1 and prompt.count(2) == 1  # <|im_start|> ... <|im_end|> ... assistant
    assert random_target_vocab("random:tiny").vocab_size == 512
    with pytest.raises(ValueError, match="at least 259"):
        random_tokenizer(100)
