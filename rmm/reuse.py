"""Controlled-reuse streams (``dataset=reuse``): filler text interleaved with records that are introduced,
echoed and recalled, every token labelled with its segment.

A record is a cue ("The passcode for gate 41 is") followed by a code of ``code_tokens`` random symbols.
Each record is *introduced*, then *echoed* ``echo_gap`` tokens after its introduction ends: exactly for a
true record (the copy queries attend to the introduction and predict right: utility), with a different code
for a decoy (the copy queries attend to the introduction and predict wrong: attention without utility).
``recall_gap`` tokens after its echo ends, every true record is *recalled*: its cue, then its code.

Streams are assembled from token ids, not text, so every label lines up with its token under any tokenizer:

- symbols are tokens: the code alphabet is the capital letters A-Z, the cue's id alphabet the digits 0-9,
  each in the spelling (" K" or "K") that the tokenizer encodes as exactly one token;
- the cue is ``tokens("\\nThe passcode for gate") + id + tokens(" is")``; ids are ``id_tokens`` digit tokens,
  distinct within a stream, so every cue is unique;
- codes are distinct within a stream; a decoy's echo differs from its introduction at *every* symbol (it
  diverges from the first code token on), so no echo token can be copied right;
- every event (cue + code) has the same length L, records start every P tokens (P >= L + ``spacing``, the
  smallest period at which no two events come closer than ``spacing`` tokens), and all other positions are
  filler: consecutive tokens of one filler document (any text source), starting at its first token.

The gaps are token distances: the echo starts exactly ``echo_gap`` tokens after the introduction's last
token and the recall exactly ``recall_gap`` tokens after the echo's last token; what lies between is filler
and other records' events. Stream ``d`` draws from its own generator, seeded by ``(seed, d)``.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SEGMENTS = ("filler", "cue", "intro", "echo", "decoy_echo", "recall")
CUE_PREFIX = "\nThe passcode for gate"
CUE_SUFFIX = " is"
CODE_SYMBOLS = string.ascii_uppercase
ID_SYMBOLS = string.digits
MIN_ALPHABET = 10
DEFAULTS: dict[str, Any] = {
    "n_records": 4,
    "n_decoys": 4,
    "code_tokens": 4,
    "id_tokens": 2,
    "echo_gap": 32,
    "recall_gap": 192,
    "lead_tokens": 32,
    "spacing": 8,
    "seed": 0,
}


@dataclass(frozen=True)
class ReuseSpec:
    """Validated generator parameters (see the module docstring)."""

    n_records: int
    n_decoys: int
    code_tokens: int
    id_tokens: int
    echo_gap: int
    recall_gap: int
    lead_tokens: int
    spacing: int
    seed: int
    max_tokens: int | None = None  # dataset.max_tokens: no stream may be longer

    @property
    def n_total(self) -> int:
        return self.n_records + self.n_decoys

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> ReuseSpec:
        """Check the ``dataset`` node's generator keys, and that a stream can fit its ``max_tokens`` (every
        generated stream is held to it again: :func:`generate`); every error names the key and the fix."""
        values = {key: cfg.get(key, default) for key, default in DEFAULTS.items()}
        minimum = {"n_records": 1, "code_tokens": 1, "id_tokens": 1, "spacing": 1}
        for key, value in values.items():
            low = minimum.get(key, 0)
            if type(value) is not int or value < low:
                raise ValueError(f"dataset.{key} must be an integer >= {low}, got {value!r}")
        spec = cls(**values, max_tokens=cfg.get("max_tokens"))
        if len(ID_SYMBOLS) ** spec.id_tokens < spec.n_total:
            raise ValueError(
                f"{spec.n_total} records need unique cue ids, but dataset.id_tokens={spec.id_tokens} gives "
                f"only {len(ID_SYMBOLS) ** spec.id_tokens}; raise dataset.id_tokens"
            )
        spec.check_fits(spec.min_length(), "at least ")
        return spec

    def check_fits(self, length: int, qualifier: str = "") -> None:
        """Refuse a stream of ``length`` tokens longer than ``max_tokens``."""
        if self.max_tokens is not None and length > self.max_tokens:
            raise ValueError(
                f"dataset=reuse: a stream with these records and gaps is {qualifier}{length} tokens, "
                f"more than dataset.max_tokens={self.max_tokens}; raise dataset.max_tokens, or lower "
                "dataset.recall_gap, dataset.echo_gap, dataset.n_records, dataset.n_decoys or "
                "dataset.lead_tokens"
            )

    def min_length(self) -> int:
        """A lower bound on the stream length under any tokenizer (cue prefix and suffix >= 1 token each)."""
        event_tokens = self.id_tokens + 2 + self.code_tokens
        echo, recall = _offsets(self, event_tokens)
        last_echo = (self.n_total - 1) * (event_tokens + self.spacing) + echo
        return self.lead_tokens + max(last_echo, recall) + event_tokens


@dataclass(frozen=True)
class ReuseStream:
    """One generated stream: ``tokens`` int64 [n], ``segments`` [n] labels from SEGMENTS, ``records``."""

    tokens: np.ndarray
    segments: np.ndarray
    records: list[dict[str, Any]]
    period: int
    event_tokens: int


class Vocabulary:
    """The token ids a tokenizer gives the cue text and the one-token symbols."""

    def __init__(self, tokenizer: Any):
        self.prefix = _encode(tokenizer, CUE_PREFIX)
        self.suffix = _encode(tokenizer, CUE_SUFFIX)
        self.code = _alphabet(tokenizer, CODE_SYMBOLS, "code")
        self.ids = _alphabet(tokenizer, ID_SYMBOLS, "cue id")

    def cue(self, record_id: Sequence[int]) -> list[int]:
        return [*self.prefix, *(self.ids[i] for i in record_id), *self.suffix]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, verbose=False).input_ids)


def _alphabet(tokenizer: Any, symbols: str, what: str) -> list[int]:
    """One token id per symbol: " X" if that is one token, else "X"; symbols with neither are dropped."""
    ids: list[int] = []
    for symbol in symbols:
        for spelling in (f" {symbol}", symbol):
            encoded = _encode(tokenizer, spelling)
            if len(encoded) == 1 and encoded[0] not in ids:
                ids.append(encoded[0])
                break
    if len(ids) < MIN_ALPHABET:
        raise ValueError(
            f"the tokenizer encodes only {len(ids)} of the {what} symbols {symbols!r} as single tokens "
            f"(need {MIN_ALPHABET}); dataset=reuse cannot build records with this tokenizer"
        )
    return ids


def _offsets(spec: ReuseSpec, event_tokens: int) -> tuple[int, int]:
    """(echo start, recall start) relative to the record's introduction start."""
    echo = event_tokens + spec.echo_gap
    return echo, echo + event_tokens + spec.recall_gap


def _period(spec: ReuseSpec, event_tokens: int, decoy: Sequence[bool]) -> int:
    """Smallest record period P >= L + spacing at which events of different records are >= L + spacing apart
    (start to start). A record's own events are as far apart as its gaps make them."""
    echo, recall = _offsets(spec, event_tokens)
    events = [(0, echo) if is_decoy else (0, echo, recall) for is_decoy in decoy]
    need = event_tokens + spec.spacing
    period = need
    while True:
        starts = sorted((i * period + offset, i) for i, offsets in enumerate(events) for offset in offsets)
        if not any(
            other != record and start - begin < need
            for k, (begin, record) in enumerate(starts)
            for start, other in starts[k + 1 : k + 8]  # a record has <= 3 events: 7 later ones suffice
        ):
            return period
        period += 1


def generate(
    spec: ReuseSpec, vocab: Vocabulary, filler: Callable[[int], np.ndarray], index: int
) -> ReuseStream:
    """Stream ``index`` of the dataset; ``filler(n)`` gives the n filler token ids (int64 [n]) it needs.
    Raises ValueError when it is longer than ``spec.max_tokens``."""
    rng = np.random.default_rng([spec.seed, index])
    decoy = np.zeros(spec.n_total, dtype=bool)
    decoy[rng.choice(spec.n_total, size=spec.n_decoys, replace=False)] = True
    id_pool = rng.choice(len(vocab.ids) ** spec.id_tokens, size=spec.n_total, replace=False)
    ids = [_digits(int(value), len(vocab.ids), spec.id_tokens) for value in id_pool]
    codes = _distinct_codes(rng, len(vocab.code), spec.code_tokens, spec.n_total)
    event_tokens = len(vocab.cue(ids[0])) + spec.code_tokens
    period = _period(spec, event_tokens, decoy.tolist())
    echo_at, recall_at = _offsets(spec, event_tokens)

    events: list[tuple[int, list[int], list[int], str]] = []  # (start, cue, code, code segment)
    records = []
    for i in range(spec.n_total):
        start = spec.lead_tokens + i * period
        cue = vocab.cue(ids[i])
        code = [vocab.code[s] for s in codes[i]]
        echo_code = code
        if decoy[i]:  # a different symbol at every position
            shifts = rng.integers(1, len(vocab.code), size=spec.code_tokens)
            echo_code = [vocab.code[(s + k) % len(vocab.code)] for s, k in zip(codes[i], shifts, strict=True)]
        events.append((start, cue, code, "intro"))
        events.append((start + echo_at, cue, echo_code, "decoy_echo" if decoy[i] else "echo"))
        record = {"id": ids[i], "decoy": bool(decoy[i]), "code": code, "echo_code": echo_code}
        record |= {"intro_start": start, "echo_start": start + echo_at, "recall_start": None}
        if not decoy[i]:
            events.append((start + recall_at, cue, code, "recall"))
            record["recall_start"] = start + recall_at
        records.append(record)

    length = max(start + event_tokens for start, *_ in events)
    spec.check_fits(length)
    tokens = np.empty(length, dtype=np.int64)
    segments = np.full(length, "filler", dtype=object)
    is_event = np.zeros(length, dtype=bool)
    for start, cue, code, code_segment in events:
        stop = start + event_tokens
        tokens[start:stop] = [*cue, *code]
        segments[start : start + len(cue)] = "cue"
        segments[start + len(cue) : stop] = code_segment
        is_event[start:stop] = True
    tokens[~is_event] = filler(int((~is_event).sum()))
    return ReuseStream(tokens, segments, records, period, event_tokens)


def _digits(value: int, base: int, width: int) -> list[int]:
    return [(value // base**k) % base for k in reversed(range(width))]


def _distinct_codes(rng: np.random.Generator, alphabet: int, length: int, count: int) -> list[list[int]]:
    """``count`` distinct codes of ``length`` symbols (uniform over the alphabet, rejection of repeats)."""
    if alphabet**length < count:
        raise ValueError(f"{count} records need distinct codes; raise dataset.code_tokens above {length}")
    codes: list[list[int]] = []
    while len(codes) < count:
        code = rng.integers(0, alphabet, size=length).tolist()
        if code not in codes:
            codes.append(code)
    return codes
