"""The suffix-index bench's text (services/bench/suffix_corpus.py): exact sizes, seeded copies with few edits,
held-out prompts never indexed, a flood of the size asked; and its options refused naming them."""

from __future__ import annotations

import random

import pytest

from services.bench.suffix_corpus import Corpus, answer_like, build_corpus, contexts, edited, fill, flood


def _corpus(num_prompts: int = 20) -> Corpus:
    turns = [[" ".join(f"w{index}x{n}" for n in range(30))] for index in range(num_prompts)]
    words: dict[str, int] = {}

    def encode(text: str) -> list[int]:
        return [words.setdefault(word, len(words)) for word in text.split()]

    return build_corpus(turns, lambda text: [900, *encode(text), 901], encode, 1000, seed=3)


def test_each_prompt_gives_a_chat_document_and_an_answer_quoting_it_and_a_tenth_is_held_out():
    corpus = _corpus()
    assert len(corpus.documents) == 18 * 2 and len(corpus.held_out) == 2 * 2
    chats = [doc for doc in corpus.documents if doc[0] == 900]
    answers = [doc for doc in corpus.documents if doc[0] != 900]
    assert len(chats) == len(answers) == 18
    for chat, answer in zip(chats, answers):
        assert set(answer) <= set(chat)  # runs of the prompt's own text
    held = {token for doc in corpus.held_out for token in doc} - {900, 901}
    assert not held & {token for doc in corpus.documents for token in doc}
    assert Corpus.from_json(corpus.to_json()) == corpus


def test_answer_like_runs_are_in_order_and_within_the_text():
    text = list(range(200))
    answer = answer_like(text, random.Random(0))
    assert answer and all(token in text for token in answer)
    assert answer_like([], random.Random(0)) == []


def test_fill_writes_exactly_the_size_with_separators_and_copies_with_few_edits():
    corpus = _corpus()
    for num_tokens in (50, 1000, 5000, 66):
        documents = fill(corpus, num_tokens, seed=1)
        assert num_tokens - 1 <= sum(len(doc) + 1 for doc in documents) <= num_tokens
    documents = fill(corpus, 5000, seed=1)
    assert documents[:len(corpus.documents)] == corpus.documents  # the first pass as it is
    assert documents == fill(corpus, 5000, seed=1)  # seeded
    copies = documents[len(corpus.documents):2 * len(corpus.documents)]
    changed = sum(a != b for copy, base in zip(copies, corpus.documents) for a, b in zip(copy, base))
    assert 0 < changed < 0.5 * sum(map(len, corpus.documents))


def test_edited_replaces_drops_and_inserts_from_the_pool_at_a_few_percent():
    doc = list(range(10_000))
    copy = edited(doc, random.Random(0), pool=[-5])
    assert 0.01 < copy.count(-5) / len(doc) < 0.06  # replaced and inserted, ~2% each
    assert 0.9 * len(doc) < len(copy) < 1.1 * len(doc)


def test_flood_is_unique_random_ids_of_the_size_asked():
    documents = list(flood(10_000, 100, vocab_size=50_000, seed=0))
    assert 9_999 <= sum(len(doc) + 1 for doc in documents) <= 10_000  # 99 of 101, and one left over
    assert all(0 <= token < 50_000 for doc in documents for token in doc)
    assert len({token for doc in documents for token in doc}) > 8000  # almost nothing repeats


def test_contexts_are_prefixes_of_the_documents_at_most_max_tokens():
    documents = [list(range(100)), list(range(1000, 1010))]
    for context in contexts(documents, 200, 16, seed=0):
        assert 2 <= len(context) <= 16
        doc = documents[0] if context[0] < 1000 else documents[1]
        start = doc.index(context[0])
        assert doc[start:start + len(context)] == context
    with pytest.raises(ValueError, match="long enough"):
        contexts([[1, 2]], 1, 16, seed=0)


@pytest.mark.parametrize(("args", "message"), [
    (["--index-tokens", "1000"], "--index-tokens is for --suffix-index"),
    (["--suffix-index", "--index-tokens", "10"], "--index-tokens: each size must be at least 1000 tokens"),
    (["--suffix-index", "--index-tokens", "lots"], "--index-tokens must be a comma list of token counts"),
    (["--suffix-index", "--overhead"], "--suffix-index measures the index alone"),
])
def test_bad_suffix_index_options_are_refused_naming_the_option(args, message):
    from typer.testing import CliRunner

    from services.cli import app

    result = CliRunner().invoke(app, ["bench", *args, "--out", "/nonexistent/never-written"])
    assert result.exit_code == 2, result.output
    assert message in result.output
