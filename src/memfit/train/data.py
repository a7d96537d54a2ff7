"""Training data: text -> tokens -> packed windows -> shuffled, sharded micro-batches.

Pipeline
--------
1. **Documents.** :func:`load_documents` turns a source into a list of strings: the built-in
   :func:`synthetic_corpus` (``"synthetic"``), one plain-text file (one document per file), a
   ``.jsonl`` file (one document per line, taken from a field), or a directory (recursively,
   every ``*.txt``, ``*.md`` and ``*.jsonl`` file in sorted path order).
2. **Tokenizer.** :func:`load_tokenizer` gives a :class:`Tokenizer`: the 258-symbol
   :class:`ByteTokenizer` (UTF-8 bytes plus BOS and EOS; needs no file) or an
   :class:`HFTokenizer` read from a local ``tokenizer.json`` (never downloaded).
3. **Packing.** :class:`PackedTokens` concatenates every document's tokens into one flat array
   with an EOS after each document, the way GPT-style pretraining does: no padding, and a window
   may span a document boundary (the EOS tells the model where one ends). Documents are encoded
   without the tokenizer's own special tokens, so a Llama ``tokenizer.json`` adds no BOS.
4. **Windows.** With sequence length ``T`` the packed array of ``N`` tokens is cut into
   ``(N - 1) // T`` non-overlapping windows of ``T + 1`` tokens; window ``i`` covers
   ``tokens[i*T : i*T + T + 1]``. Consecutive windows share one token, so every token except
   the very first is a target exactly once per epoch.
5. **Batches.** :class:`TokenBatches` yields ``(inputs, targets)`` micro-batches forever. Epoch
   ``e`` is a permutation of all window indices drawn from ``np.random.default_rng([seed, e])``;
   rank ``r`` of ``W`` takes permutation positions ``r, r + W, r + 2W, ...`` so the ranks see
   disjoint windows. Every rank gets the same number of micro-batches per epoch
   (``(num_windows // W) // micro_batch``), so ranks stay in the same epoch; the windows that do
   not fill the last micro-batch are dropped and the next epoch begins.

Exact resume
------------
The iterator's whole state is ``(epoch, position)``: the permutation of an epoch is a pure
function of ``(seed, epoch)``, so :meth:`TokenBatches.load_state_dict` followed by ``next``
produces exactly the batches the uninterrupted iterator would have. All ranks advance in
lockstep, so rank 0's state restores every rank.

:func:`build_data` is the one-call entry point the engine uses.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "PackedTokens",
    "TokenBatches",
    "Tokenizer",
    "build_data",
    "load_documents",
    "load_tokenizer",
    "synthetic_corpus",
]

DOCUMENT_EXTENSIONS = (".txt", ".md", ".jsonl")
EOS_TOKEN_NAMES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|im_end|>")
BOS_TOKEN_NAMES = ("<s>", "<|begin_of_text|>", "<bos>")


# --------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline and generation need from a tokenizer.

    ``eos_id`` ends every packed document; ``bos_id`` is ``None`` when the vocabulary has no
    begin-of-sequence token. ``name`` is what checkpoints record to identify the tokenizer.
    """

    vocab_size: int
    eos_id: int
    bos_id: int | None
    name: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are the UTF-8 bytes, 256 is BOS, 257 is EOS.

    Needs no file and round-trips any string. ``decode`` drops the special ids and replaces
    invalid UTF-8 (e.g. a multi-byte character cut by sampling) with U+FFFD.
    """

    vocab_size: int = 258
    bos_id: int | None = 256
    eos_id: int = 257
    name: str = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytearray()
        for token in ids:
            token = int(token)
            if 0 <= token < 256:
                data.append(token)
            elif token not in (self.bos_id, self.eos_id):
                raise ValueError(
                    f"ByteTokenizer.decode got id {token}, outside its vocabulary 0..257; "
                    "was the model built with a different tokenizer's vocab_size?"
                )
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer read from a local ``tokenizer.json``.

    EOS is the first of ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>``,
    ``<|im_end|>`` present in the vocabulary; BOS the first of ``<s>``, ``<|begin_of_text|>``,
    ``<bos>`` (or ``None``). ``encode`` adds no special tokens (packing adds EOS itself);
    ``decode`` skips them.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"tokenizer file {str(path)!r} does not exist; pass 'byte' or the path of a "
                "local tokenizer.json (memfit never downloads tokenizers)"
            )
        try:
            self._tokenizer = _RustTokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises a bare Exception on bad JSON
            raise ValueError(
                f"could not read {str(path)!r} as a Hugging Face tokenizer.json: {error}"
            ) from error
        self.name: str = str(path)
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        eos_id = next((vocab[name] for name in EOS_TOKEN_NAMES if name in vocab), None)
        if eos_id is None:
            raise ValueError(
                f"tokenizer {str(path)!r} has no EOS token: tried {', '.join(EOS_TOKEN_NAMES)}; "
                "packing needs one to mark where each document ends"
            )
        self.eos_id: int = eos_id
        self.bos_id: int | None = next(
            (vocab[name] for name in BOS_TOKEN_NAMES if name in vocab), None
        )

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes in parallel on the Rust side; much faster than ``encode`` in a loop."""
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode([int(token) for token in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` -> :class:`ByteTokenizer`; a ``tokenizer.json`` path, or a directory holding
    one (e.g. a downloaded model folder) -> :class:`HFTokenizer`."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer {spec!r} not found (looked for {str(path)!r}); pass 'byte' or the path "
            "of a local tokenizer.json or of a directory containing one"
        )
    return HFTokenizer(path)


# --------------------------------------------------------------------------------------------
# Synthetic corpus
# --------------------------------------------------------------------------------------------

_NAMES = (
    "mia", "leo", "ava", "sam", "zoe", "max", "ivy", "ben", "eli", "ana", "tom", "lia",
    "noa", "kai", "ida", "ole", "una", "rex", "amy", "jon", "eva", "tim", "liv", "dan",
    "pia", "roy", "isa", "ugo", "nia", "bo",
)  # fmt: skip
_OBJECTS = (
    ("apple", "apples"), ("pear", "pears"), ("coin", "coins"), ("book", "books"),
    ("stone", "stones"), ("shell", "shells"), ("card", "cards"), ("egg", "eggs"),
    ("plum", "plums"), ("marble", "marbles"), ("pencil", "pencils"), ("cookie", "cookies"),
    ("flower", "flowers"), ("nut", "nuts"), ("ball", "balls"), ("cup", "cups"),
)  # fmt: skip
_COLORS = ("red", "blue", "green", "yellow", "black", "white")
_PLACES = (
    "the market", "the park", "the lake", "the farm", "the school", "the beach", "the garden",
    "the mill", "the zoo", "the shop", "the hill", "the river",
)  # fmt: skip
_CITIES = ("oslo", "lima", "rome", "kyiv", "cairo", "dakar", "quito", "hanoi", "perth", "bern")
_DAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")


def _amount(count: int, obj: tuple[str, str]) -> str:
    if count == 0:
        return f"no {obj[1]}"
    return f"{count} {obj[0] if count == 1 else obj[1]}"


def _and_list(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def _trade_story(rng: random.Random, cast: list[str], theme: list[tuple[str, str]]) -> str:
    """Possessions that change by gives, finds and losses, with the running totals stated."""
    obj = rng.choice(theme)
    a, b = rng.sample(cast, 2)
    have = {a: rng.randrange(1, 10), b: rng.randrange(1, 10)}
    out = [f"{a} has {_amount(have[a], obj)} and {b} has {_amount(have[b], obj)}."]
    for _ in range(rng.randrange(2, 6)):
        who = rng.choice((a, b))
        other = b if who == a else a
        event = rng.randrange(3) if have[who] > 0 else 1
        if event == 0:
            k = rng.randrange(1, have[who] + 1)
            have[who] -= k
            have[other] += k
            out.append(f"{who} gives {other} {_amount(k, obj)}.")
        elif event == 1:
            k = rng.randrange(1, 7)
            have[who] += k
            out.append(f"{who} finds {_amount(k, obj)}.")
        else:
            k = rng.randrange(1, have[who] + 1)
            have[who] -= k
            out.append(f"{who} loses {_amount(k, obj)}.")
        out.append(f"now {who} has {_amount(have[who], obj)}.")
    out.append(
        f"in the end {a} has {_amount(have[a], obj)} and {b} has {_amount(have[b], obj)}."
        f" together they have {_amount(have[a] + have[b], obj)}."
    )
    return " ".join(out)


def _shopping_story(rng: random.Random, cast: list[str], theme: list[tuple[str, str]]) -> str:
    """A list that is repeated later in the same order (a copy task for attention)."""
    who = rng.choice(cast)
    objects = rng.sample(_OBJECTS, rng.randrange(2, 5))
    items = _and_list([_amount(rng.randrange(1, 10), obj) for obj in objects])
    place = rng.choice(_PLACES)
    return f"{who} goes to {place} and buys {items}. at home {who} has {items}."


def _record_story(rng: random.Random, cast: list[str], theme: list[tuple[str, str]]) -> str:
    """A small table of facts, then questions answered from it."""
    facts = {
        person: (rng.randrange(5, 60), rng.choice(_CITIES), rng.choice(theme)[1]) for person in cast
    }
    out = ["record:"]
    for person, (age, city, likes) in facts.items():
        out.append(f"name={person} age={age} city={city} likes={likes}")
    for person in rng.sample(cast, len(cast)):
        age, city, likes = facts[person]
        question = rng.randrange(3)
        if question == 0:
            out.append(f"how old is {person}? {person} is {age} years old.")
        elif question == 1:
            out.append(f"where does {person} live? {person} lives in {city}.")
        else:
            out.append(f"what does {person} like? {person} likes {likes}.")
    return "\n".join(out)


def _counting_story(rng: random.Random, cast: list[str], theme: list[tuple[str, str]]) -> str:
    """Arithmetic progressions: counting objects, down to zero, or by a fixed step."""
    who = rng.choice(cast)
    kind = rng.randrange(3)
    if kind == 0:
        obj = rng.choice(theme)
        count = rng.randrange(2, 12)
        numbers = ", ".join(str(n) for n in range(1, count + 1))
        return f"{who} counts the {obj[1]}: {numbers}. {who} has {_amount(count, obj)}."
    if kind == 1:
        start = rng.randrange(3, 12)
        numbers = ", ".join(str(n) for n in range(start, -1, -1))
        return f"{who} counts down from {start}: {numbers}."
    step = rng.randrange(2, 6)
    numbers = ", ".join(str(n) for n in range(step, step * rng.randrange(4, 9) + 1, step))
    return f"{who} counts by {step}: {numbers}."


def _dialogue_story(rng: random.Random, cast: list[str], theme: list[tuple[str, str]]) -> str:
    """Question and answer where the answer repeats the question's entities."""
    a, b = rng.sample(cast, 2)
    color, thing, place = rng.choice(_COLORS), rng.choice(theme)[0], rng.choice(_PLACES)
    lines = [f"{a}: {b}, where is my {color} {thing}?", f"{b}: your {color} {thing} is at {place}."]
    if rng.randrange(2):
        lines.append(f"{a}: thank you, {b}. i see my {color} {thing} at {place}.")
    else:
        other = rng.choice([c for c in _COLORS if c != color])
        lines.append(f"{a}: no, that is the {other} {thing}.")
        lines.append(f"{b}: then your {color} {thing} is at {rng.choice(_PLACES)}.")
    return "\n".join(lines)


def _week_story(rng: random.Random, cast: list[str], theme: list[tuple[str, str]]) -> str:
    """The days of the week in order, each with an outing."""
    who = rng.choice(cast)
    first = rng.randrange(7)
    days = [_DAYS[(first + i) % 7] for i in range(rng.randrange(2, 6))]
    out = [f"on {day} {who} goes to {rng.choice(_PLACES)}." for day in days]
    out.append(f"on {_DAYS[(first + len(days)) % 7]} {who} stays at home.")
    return " ".join(out)


_STORY_KINDS = (
    _trade_story,
    _shopping_story,
    _record_story,
    _counting_story,
    _dialogue_story,
    _week_story,
)


def synthetic_corpus(num_documents: int = 4000, seed: int = 1234) -> list[str]:
    """A generated corpus that a small byte-level model visibly learns in a couple hundred steps.

    Each document has a cast of 2-4 names (of 30), a theme of 3 objects (of 16) and 3-6
    paragraphs separated by a blank line, each drawn from six kinds of lowercase ASCII text:

    - **trade**: ``mia has 3 apples and leo has 5 apples. leo gives mia 4 apples. now leo has
      1 apple. ... together they have 8 apples.``: gives, finds and losses with the running
      totals stated, consistent arithmetic and singular/plural agreement;
    - **shopping**: ``mia goes to the market and buys 3 pears and 1 egg. at home mia has 3 pears
      and 1 egg.``: a list repeated verbatim (a copy task for attention);
    - **record**: a ``name=mia age=9 city=oslo likes=plums`` table, then questions answered
      from it (``where does mia live? mia lives in oslo.``);
    - **counting**: counting the objects (``1, 2, 3. mia has 3 coins.``), down to zero, or by
      a step of 2-5;
    - **dialogue**: ``mia: leo, where is my red cup?`` / ``leo: your red cup is at the park.``
      and a reply that repeats or corrects it;
    - **week**: consecutive weekdays, each with an outing, wrapping from sunday to monday.

    Names, objects and places are shared by all kinds and repeat within a document; the phrases
    are rigid and the arithmetic is always right, so there is a lot to learn at every scale,
    from spelling to copying and counting, while the random names, numbers and lists keep the
    text from being periodic. Documents average about 700 bytes. Measured on the default
    corpus: byte unigram entropy 3.12 nats, conditional entropy given the previous 1, 2, 3 bytes
    2.18, 1.19, 0.72 nats; ``memfit train`` (preset ``tiny``, 8 x 256 tokens per step) reaches
    a loss of about 1.3 nats after 100 steps and 0.55 after 200.

    Deterministic: only ``random.Random(seed)`` is used (no global state, no ``hash``), so the
    same arguments give a byte-identical corpus on every platform and Python version.
    """
    if num_documents < 1:
        raise ValueError(f"num_documents must be >= 1, got {num_documents}")
    rng = random.Random(seed)
    documents = []
    for _ in range(num_documents):
        cast = rng.sample(_NAMES, rng.randrange(2, 5))
        theme = rng.sample(_OBJECTS, 3)
        kinds = [rng.choice(_STORY_KINDS) for _ in range(rng.randrange(3, 7))]
        documents.append("\n\n".join(kind(rng, cast, theme) for kind in kinds))
    return documents


# --------------------------------------------------------------------------------------------
# Documents
# --------------------------------------------------------------------------------------------


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"{str(path)!r} is not UTF-8 text ({error}); convert it or remove it from the data"
        ) from error


def _read_jsonl(path: Path, field: str) -> list[str]:
    documents = []
    # split("\n"), not splitlines(): a JSON string may hold a raw U+2028 or form feed.
    for line_number, line in enumerate(_read_text(path).split("\n"), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{str(path)}:{line_number} is not valid JSON: {error}") from error
        if not isinstance(record, dict) or field not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(
                f"{str(path)}:{line_number} has no field {field!r} (it has {keys}); "
                "name the field that holds the text with jsonl_field (--set data.jsonl_field=NAME)"
            )
        text = record[field]
        if not isinstance(text, str):
            raise ValueError(
                f"{str(path)}:{line_number}: field {field!r} is a {type(text).__name__}, "
                "expected a string"
            )
        documents.append(text)
    return documents


def _read_file(path: Path, field: str) -> list[str]:
    if path.suffix.lower() == ".jsonl":
        return _read_jsonl(path, field)
    return [_read_text(path)]


def load_documents(source: str, *, jsonl_field: str = "text") -> list[str]:
    """Documents from ``"synthetic"``, a file or a directory.

    - ``"synthetic"``: :func:`synthetic_corpus` with its defaults;
    - a ``.jsonl`` file: one document per non-blank line, from the ``jsonl_field`` key;
    - any other file: the whole file is one document (UTF-8);
    - a directory: every ``*.txt``, ``*.md`` and ``*.jsonl`` file below it, recursively, in
      sorted path order (so the order does not depend on the file system).
    """
    if source == "synthetic":
        return synthetic_corpus()
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(
            f"data source {source!r} does not exist; pass 'synthetic', a .txt/.md/.jsonl file, "
            "or a directory of them"
        )
    if path.is_file():
        return _read_file(path, jsonl_field)
    files = sorted(
        (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in DOCUMENT_EXTENSIONS),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise ValueError(
            f"directory {source!r} has no {', '.join('*' + e for e in DOCUMENT_EXTENSIONS)} "
            "files (searched recursively)"
        )
    documents = []
    for file in files:
        documents.extend(_read_file(file, jsonl_field))
    return documents


# --------------------------------------------------------------------------------------------
# Packing and batching
# --------------------------------------------------------------------------------------------


def _token_dtype(vocab_size: int) -> np.dtype:
    # Ids are < vocab_size, so uint16 holds every id of a vocabulary of up to 2**16 entries and
    # halves the memory of int32 for byte-level and 32k-vocabulary (Llama 2, Mistral) corpora.
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.int32)


@dataclass(frozen=True)
class PackedTokens:
    """A tokenized corpus as one flat array, an EOS after every document.

    Basics: ``tokens`` has shape ``(num_tokens,)``, dtype uint16 when the vocabulary fits in 16
    bits, else int32. Build it with :meth:`from_documents`.

    Details: with sequence length ``T`` there are ``(num_tokens - 1) // T`` windows of ``T + 1``
    tokens; window ``i`` is ``tokens[i*T : i*T + T + 1]`` (inputs are its first ``T`` tokens,
    targets its last ``T``). The last ``(num_tokens - 1) % T`` tokens are never targets.
    """

    tokens: np.ndarray
    eos_id: int
    num_documents: int

    @classmethod
    def from_documents(cls, documents: Sequence[str], tokenizer: Tokenizer) -> PackedTokens:
        """Tokenizes ``documents`` (in one ``encode_batch`` call when the tokenizer has one)
        and concatenates them, each followed by ``tokenizer.eos_id``."""
        dtype = _token_dtype(tokenizer.vocab_size)
        if isinstance(tokenizer, ByteTokenizer):
            # Fast path: the UTF-8 bytes are the ids, so skip the Python lists entirely.
            encoded_bytes = [document.encode("utf-8") for document in documents]
            lengths = np.fromiter(map(len, encoded_bytes), dtype=np.int64, count=len(documents))
            flat = np.frombuffer(b"".join(encoded_bytes), dtype=np.uint8).astype(dtype)
        else:
            encode_batch = getattr(tokenizer, "encode_batch", None)
            if encode_batch is not None:
                encoded = encode_batch(list(documents))
            else:
                encoded = [tokenizer.encode(document) for document in documents]
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
            flat = np.fromiter(
                itertools.chain.from_iterable(encoded), dtype=dtype, count=int(lengths.sum())
            )
        # Inserting at the cumulative lengths puts one EOS right after each document.
        tokens = np.insert(flat, np.cumsum(lengths), tokenizer.eos_id)
        return cls(tokens=tokens, eos_id=tokenizer.eos_id, num_documents=len(lengths))

    def __len__(self) -> int:
        return len(self.tokens)

    def num_sequences(self, seq_len: int) -> int:
        """Number of windows of ``seq_len + 1`` tokens starting at multiples of ``seq_len``."""
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        count = (len(self.tokens) - 1) // seq_len
        if count < 1:
            raise ValueError(
                f"the corpus has {len(self.tokens)} tokens but one sequence of seq_len={seq_len} "
                f"needs {seq_len + 1}; use a shorter --seq-len or more data"
            )
        return count

    def windows(self, indices: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows ``indices`` (shape ``(n,)``) as an int64 array of shape ``(n, seq_len + 1)``."""
        starts = np.asarray(indices, dtype=np.int64) * seq_len
        offsets = np.arange(seq_len + 1, dtype=np.int64)
        return self.tokens[starts[:, None] + offsets[None, :]].astype(np.int64)  # (n, T + 1)


class TokenBatches:
    """Infinite iterator of shuffled, rank-sharded micro-batches ``(inputs, targets)``.

    Basics: ``next(batches)`` returns two CPU LongTensors of shape ``(micro_batch, seq_len)``;
    ``targets[:, t] == inputs[:, t + 1]`` for ``t < seq_len - 1`` (both come from one window of
    ``seq_len + 1`` tokens). Save :meth:`state_dict` with the checkpoint and restore it with
    :meth:`load_state_dict` to continue with exactly the batches an uninterrupted run would see.

    Details: epoch ``e`` permutes all window indices with ``np.random.default_rng([seed, e])``;
    rank ``r`` takes positions ``r, r + world_size, ...`` of the permutation, ``micro_batch`` at
    a time. Each rank yields ``(num_windows // world_size) // micro_batch`` micro-batches per
    epoch, the same on every rank; the remaining windows of the epoch are dropped.
    """

    def __init__(
        self,
        tokens: PackedTokens,
        *,
        seq_len: int,
        micro_batch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"rank must be in [0, {world_size}) for world_size={world_size}, got {rank}"
            )
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.num_windows = tokens.num_sequences(seq_len)
        windows_per_rank = self.num_windows // world_size
        self.batches_per_epoch = windows_per_rank // micro_batch
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"each of the {world_size} rank(s) gets {windows_per_rank} window(s) of "
                f"{seq_len + 1} tokens per epoch ({len(tokens)} tokens in all), fewer than "
                f"micro_batch={micro_batch}; use a shorter --seq-len, a smaller --micro-batch "
                "or more data"
            )
        self.epoch = 0
        self.position = 0  # micro-batches already yielded in this epoch
        self._cached_epoch = -1
        self._cached_windows = np.empty((0, micro_batch), dtype=np.int64)

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one micro-batch on this rank: ``micro_batch * seq_len``."""
        return self.micro_batch * self.seq_len

    def epoch_windows(self, epoch: int) -> np.ndarray:
        """This rank's window indices for ``epoch``, shape ``(batches_per_epoch, micro_batch)``:
        row ``b`` holds the windows of the epoch's ``b``-th micro-batch."""
        if epoch != self._cached_epoch:
            permutation = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            used = self.batches_per_epoch * self.micro_batch * self.world_size
            mine = permutation[self.rank : used : self.world_size]  # (batches * micro_batch,)
            self._cached_windows = mine.reshape(self.batches_per_epoch, self.micro_batch)
            self._cached_epoch = epoch
        return self._cached_windows

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        indices = self.epoch_windows(self.epoch)[self.position]
        windows = torch.from_numpy(self.tokens.windows(indices, self.seq_len))  # (B, T + 1)
        self.position += 1
        if self.position == self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, T), (B, T)

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch, plus the settings that must match on resume."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_windows": self.num_windows,
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`). Only ``epoch`` and ``position``
        are required; a differing seed, corpus size, seq_len, micro_batch or world_size is
        allowed but logged, since the batches will then not match the interrupted run's."""
        missing = [key for key in ("epoch", "position") if key not in state]
        if missing:
            raise ValueError(
                f"data state is missing {missing} (it has {sorted(state)}); "
                "was it saved by TokenBatches.state_dict()?"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.batches_per_epoch:
            raise ValueError(
                f"data state epoch={epoch}, position={position} is out of range: an epoch has "
                f"{self.batches_per_epoch} micro-batches here; was it saved with other data "
                "settings (--data, --seq-len, --micro-batch, world size)?"
            )
        changed = [
            f"{key} {state[key]} -> {getattr(self, key)}"
            for key in ("seed", "num_windows", "seq_len", "micro_batch", "world_size")
            if key in state and int(state[key]) != getattr(self, key)
        ]
        if changed:
            logger.warning(
                "resuming data at epoch %d, batch %d with changed settings (%s): "
                "the batches will differ from those of the interrupted run",
                epoch,
                position,
                ", ".join(changed),
            )
        self.epoch, self.position = epoch, position


def build_data(
    source: str,
    tokenizer: str,
    *,
    seq_len: int,
    micro_batch: int,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    jsonl_field: str = "text",
) -> tuple[Tokenizer, TokenBatches]:
    """Loads ``source`` (see :func:`load_documents`), tokenizes it with ``tokenizer`` (see
    :func:`load_tokenizer`), packs it and returns the tokenizer and this rank's batches."""
    loaded_tokenizer = load_tokenizer(tokenizer)
    documents = load_documents(source, jsonl_field=jsonl_field)
    packed = PackedTokens.from_documents(documents, loaded_tokenizer)
    batches = TokenBatches(
        packed,
        seq_len=seq_len,
        micro_batch=micro_batch,
        seed=seed,
        rank=rank,
        world_size=world_size,
    )
    if rank == 0:
        logger.info(
            "data %s: %d documents, %d tokens (%s tokenizer, vocab %d); %d windows of %d tokens, "
            "%d micro-batches of %d per rank per epoch",
            source,
            packed.num_documents,
            len(packed),
            loaded_tokenizer.name,
            loaded_tokenizer.vocab_size,
            batches.num_windows,
            seq_len + 1,
            batches.batches_per_epoch,
            micro_batch,
        )
    return loaded_tokenizer, batches
