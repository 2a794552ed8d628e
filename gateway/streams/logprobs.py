"""A session's log probabilities in OpenAI's two shapes: chat's `logprobs.content` (token, logprob, bytes,
top_logprobs) and completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`.

The numbers come from the verify worker with each output event (services/speculative/processing.py); here they
only get their tokens' text. A token's bytes are its own, not its decoding's: a byte-level BPE token that holds
half of a UTF-8 character has the bytes of that half (its text shows the replacement character), as OpenAI gives
them."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from services.protocol import OutputEvent


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2's scheme) spells each byte as one printable character: the printable Latin-1 bytes
    as themselves, the other 68 bytes as the characters from U+0100 on, in byte order. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    alphabet = {chr(byte): byte for byte in printable}
    others = [byte for byte in range(256) if byte not in alphabet.values()]
    alphabet.update({chr(256 + index): byte for index, byte in enumerate(others)})
    return alphabet


BYTE_LEVEL = _byte_level_alphabet()


class TokenStrings:
    """Token id -> (text, bytes), from the tokenizer's own spelling of the token, cached."""

    def __init__(self, tokenizer: object) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        sample = tokenizer.convert_ids_to_tokens(tokenizer.encode(" a b\n", add_special_tokens=False))
        self.byte_level = all(isinstance(t, str) and all(ch in BYTE_LEVEL for ch in t) for t in sample) and any(
            "\u0120" in t for t in sample)  # "Ġ": a space in GPT-2's spelling

    def get(self, token_id: int) -> tuple[str, list[int]]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._spell(token_id)
        return found

    def _spell(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and self.byte_level and all(ch in BYTE_LEVEL for ch in piece):
            raw = bytes(BYTE_LEVEL[ch] for ch in piece)
            return raw.decode("utf-8", errors="replace"), list(raw)
        if isinstance(piece, str) and piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            raw = bytes([int(piece[3:5], 16)])  # SentencePiece's byte fallback
            return raw.decode("utf-8", errors="replace"), list(raw)
        text = self.tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


@functools.lru_cache(maxsize=4)
def token_strings(tokenizer: object) -> TokenStrings:
    """One TokenStrings per tokenizer (a gateway serves one model)."""
    return TokenStrings(tokenizer)


@dataclass
class Entry:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def entries(event: OutputEvent) -> list[Entry]:
    """An event's tokens with their log probabilities ([] when the request asked for none)."""
    if len(event.logprobs) != len(event.token_ids):
        return []
    return [Entry(token_id, logprob, list(zip(ids, values)))
            for token_id, logprob, ids, values in zip(event.token_ids, event.logprobs, event.top_ids,
                                                      event.top_logprobs)]


def chat_logprobs(items: list[Entry], strings: TokenStrings) -> dict:
    def one(token_id: int, logprob: float) -> dict:
        text, raw = strings.get(token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**one(item.token_id, item.logprob), "top_logprobs": [one(i, v) for i, v in item.top]}
                        for item in items],
            "refusal": None}


def completion_logprobs(items: list[Entry], strings: TokenStrings, offset: int = 0) -> dict:
    """`offset`: the text offset of the first item (the characters of the tokens before it)."""
    tokens, offsets = [], []
    for item in items:
        offsets.append(offset)
        text = strings.get(item.token_id)[0]
        tokens.append(text)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [item.logprob for item in items],
            "top_logprobs": [{strings.get(i)[0]: v for i, v in item.top} for item in items],
            "text_offset": offsets}


class LogprobsCursor:
    """The log probabilities of one answer, as events bring them; `take()` gives those not yet sent, in the
    endpoint's shape (None when the request asked for none)."""

    def __init__(self, strings: TokenStrings | None, chat: bool) -> None:
        self.strings, self.chat = strings, chat
        self.items: list[Entry] = []
        self._sent = 0
        self._offset = 0

    def feed(self, event: OutputEvent) -> None:
        if self.strings is not None:
            self.items.extend(entries(event))

    def take(self, everything: bool = False) -> dict | None:
        """The entries since the last take (all of them with `everything`)."""
        if self.strings is None:
            return None
        start = 0 if everything else self._sent
        items = self.items[start:]
        self._sent = len(self.items)
        if self.chat:
            return chat_logprobs(items, self.strings)
        offset = 0 if everything else self._offset
        shaped = completion_logprobs(items, self.strings, offset)
        if not everything:
            self._offset = offset + sum(len(t) for t in shaped["tokens"])
        return shaped
