"""Tests for memfit.train.data: tokenizers, documents, packing, batching and exact resume."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from memfit.train.data import (
    ByteTokenizer,
    HFTokenizer,
    PackedTokens,
    TokenBatches,
    Tokenizer,
    build_data,
    load_documents,
    load_tokenizer,
    synthetic_corpus,
)

SAMPLES = ["hello world", "", "héllo, wörld: ünïcode — 日本語 🙂", "tabs\tand\nnewlines\r\n"]


# ---------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tokenizer = ByteTokenizer()
    assert isinstance(tokenizer, Tokenizer)
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (258, 256, 257)
    for text in SAMPLES:
        ids = tokenizer.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id]) == text


def test_byte_tokenizer_decode_replaces_cut_characters_and_rejects_foreign_ids() -> None:
    tokenizer = ByteTokenizer()
    cut = tokenizer.encode("é")[:1]  # first byte of a two-byte character
    assert tokenizer.decode(cut) == "\ufffd"
    with pytest.raises(ValueError, match="id 300"):
        tokenizer.decode([104, 300])


def _train_bpe(path: Path, special_tokens: list[str]) -> None:
    tokenizer = RustTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(
        ["the cat sat on the mat", "the dog ate the cat food"] * 5, trainer
    )
    tokenizer.save(str(path))


@pytest.fixture
def hf_tokenizer_path(tmp_path: Path) -> Path:
    path = tmp_path / "model" / "tokenizer.json"
    path.parent.mkdir()
    _train_bpe(path, ["<s>", "</s>"])
    return path


def test_hf_tokenizer_loads_and_round_trips(hf_tokenizer_path: Path) -> None:
    reference = RustTokenizer.from_file(str(hf_tokenizer_path))
    for spec in (str(hf_tokenizer_path), str(hf_tokenizer_path.parent)):
        tokenizer = load_tokenizer(spec)
        assert isinstance(tokenizer, HFTokenizer)
        assert isinstance(tokenizer, Tokenizer)
        assert tokenizer.eos_id == reference.token_to_id("</s>")
        assert tokenizer.bos_id == reference.token_to_id("<s>")
        assert tokenizer.vocab_size == reference.get_vocab_size(with_added_tokens=True)
        assert tokenizer.name == str(hf_tokenizer_path)
        for text in SAMPLES:
            ids = tokenizer.encode(text)
            assert tokenizer.eos_id not in ids and tokenizer.bos_id not in ids
            assert tokenizer.decode(ids) == text
            assert tokenizer.decode([tokenizer.bos_id, *ids, tokenizer.eos_id]) == text
        assert tokenizer.encode_batch(SAMPLES) == [tokenizer.encode(text) for text in SAMPLES]


def test_hf_tokenizer_without_eos_is_rejected(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    _train_bpe(path, ["<pad>"])
    with pytest.raises(ValueError, match=r"no EOS token: tried </s>, <\|endoftext\|>"):
        load_tokenizer(str(path))


def test_missing_tokenizer_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere.json"):
        load_tokenizer(str(tmp_path / "nowhere.json"))
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path))  # a directory without tokenizer.json


# ---------------------------------------------------------------------------- synthetic corpus


def test_synthetic_corpus_is_deterministic_and_varied() -> None:
    documents = synthetic_corpus()
    assert documents == synthetic_corpus()
    assert len(documents) == 4000
    assert len(set(documents)) == len(documents)
    assert synthetic_corpus(num_documents=50, seed=1) != synthetic_corpus(num_documents=50, seed=2)
    assert synthetic_corpus(num_documents=50) == documents[:50]
    text = "".join(documents)
    assert text.isascii()
    assert 200 < len(text) / len(documents) < 2000
    # Every kind of paragraph occurs.
    for marker in (" gives ", " buys ", "record:", " counts ", ", where is my ", " stays at home"):
        assert marker in text


def test_synthetic_corpus_arithmetic_is_consistent() -> None:
    totals = re.findall(
        r"in the end \w+ has (no|\d+) \w+ and \w+ has (no|\d+) \w+\. together they have (no|\d+)",
        "\n".join(synthetic_corpus(num_documents=500)),
    )
    assert len(totals) > 100
    for first, second, together in totals:
        count = [0 if word == "no" else int(word) for word in (first, second, together)]
        assert count[0] + count[1] == count[2]


# ---------------------------------------------------------------------------- documents


def test_load_documents_synthetic() -> None:
    assert load_documents("synthetic") == synthetic_corpus()


def test_load_documents_text_file(tmp_path: Path) -> None:
    path = tmp_path / "book.txt"
    path.write_text("first paragraph.\n\nsecond paragraph, ünïcode.\n", encoding="utf-8")
    assert load_documents(str(path)) == ["first paragraph.\n\nsecond paragraph, ünïcode.\n"]


def test_load_documents_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": "one", "id": "1"}), "", json.dumps({"body": "two", "text": "2"})]
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    assert load_documents(str(path)) == ["one", "2"]
    # Line numbers count the blank lines, so they match an editor's.
    with pytest.raises(
        ValueError, match=r"data.jsonl:3 has no field 'id' \(it has \['body', 'text'\]\)"
    ):
        load_documents(str(path), jsonl_field="id")


def test_load_documents_directory(tmp_path: Path) -> None:
    (tmp_path / "b" / "deep").mkdir(parents=True)
    (tmp_path / "b" / "deep" / "z.md").write_text("markdown")
    (tmp_path / "b" / "a.txt").write_text("text")
    (tmp_path / "c.jsonl").write_text(
        json.dumps({"text": "line 1"}) + "\n" + json.dumps({"text": "line 2"})
    )
    (tmp_path / "a.csv").write_text("not,a,document")
    assert load_documents(str(tmp_path)) == ["text", "markdown", "line 1", "line 2"]

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.csv").write_text("x")
    with pytest.raises(ValueError, match=r"empty.*\*\.txt, \*\.md, \*\.jsonl"):
        load_documents(str(empty))


def test_load_documents_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no_such_corpus"):
        load_documents(str(tmp_path / "no_such_corpus"))


# ---------------------------------------------------------------------------- packing


def test_packing_puts_eos_after_every_document(hf_tokenizer_path: Path) -> None:
    packed = PackedTokens.from_documents(["ab", "", "c"], ByteTokenizer())
    assert packed.tokens.tolist() == [97, 98, 257, 257, 99, 257]
    assert packed.tokens.dtype == np.uint16
    assert packed.num_documents == 3

    tokenizer = load_tokenizer(str(hf_tokenizer_path))
    documents = ["the cat sat", "on the mat", "é"]
    packed = PackedTokens.from_documents(documents, tokenizer)
    expected = [
        t for document in documents for t in [*tokenizer.encode(document), tokenizer.eos_id]
    ]
    assert packed.tokens.tolist() == expected


def test_num_sequences_counts_windows_of_seq_len_plus_one() -> None:
    packed = PackedTokens(tokens=np.arange(21, dtype=np.int32), eos_id=0, num_documents=1)
    assert packed.num_sequences(4) == 5  # the last window is tokens[16:21]
    assert packed.num_sequences(5) == 4  # tokens[15:21]
    assert packed.num_sequences(20) == 1
    assert packed.windows(np.array([4, 0]), 4).tolist() == [list(range(16, 21)), list(range(0, 5))]


def test_too_short_corpus_is_rejected() -> None:
    packed = PackedTokens.from_documents(["hi"], ByteTokenizer())  # 'h', 'i', EOS
    with pytest.raises(ValueError, match=r"3 tokens but one sequence of seq_len=8 needs 9"):
        packed.num_sequences(8)
    with pytest.raises(ValueError, match=r"3 tokens but one sequence"):
        TokenBatches(packed, seq_len=8, micro_batch=1, seed=0)


# ---------------------------------------------------------------------------- batching


def _counting_tokens(num_tokens: int) -> PackedTokens:
    # Token t has value t, so a window's index is inputs[:, 0] // seq_len.
    return PackedTokens(tokens=np.arange(num_tokens, dtype=np.int32), eos_id=0, num_documents=1)


def _window_ids(inputs: torch.Tensor, seq_len: int) -> list[int]:
    return (inputs[:, 0] // seq_len).tolist()


def test_targets_are_inputs_shifted_by_one() -> None:
    seq_len, micro_batch = 7, 3
    batches = TokenBatches(_counting_tokens(200), seq_len=seq_len, micro_batch=micro_batch, seed=5)
    assert batches.tokens_per_batch == 21
    for _ in range(10):
        inputs, targets = next(batches)
        assert inputs.shape == targets.shape == (micro_batch, seq_len)
        assert inputs.dtype == targets.dtype == torch.long
        assert inputs.device.type == "cpu"
        assert torch.equal(targets[:, :-1], inputs[:, 1:])
        # Each row is one window tokens[i*T : i*T + T + 1] split into inputs and targets.
        starts = inputs[:, :1] // seq_len * seq_len
        assert torch.equal(inputs, starts + torch.arange(seq_len))
        assert torch.equal(targets, starts + 1 + torch.arange(seq_len))


def test_epochs_are_permutations_with_the_remainder_dropped() -> None:
    seq_len, micro_batch = 4, 3
    batches = TokenBatches(
        _counting_tokens(4 * 17 + 1), seq_len=seq_len, micro_batch=micro_batch, seed=0
    )
    assert (batches.num_windows, batches.batches_per_epoch) == (17, 5)
    epochs = []
    for _ in range(3):
        seen = [w for _ in range(5) for w in _window_ids(next(batches)[0], seq_len)]
        assert len(set(seen)) == 15 and set(seen) <= set(range(17))
        epochs.append(seen)
    assert epochs[0] != epochs[1] != epochs[2]
    assert batches.state_dict()["epoch"] == 3


@pytest.mark.parametrize("consumed", [0, 1, 4, 5, 6, 13])
def test_resume_gives_the_same_batches_as_an_uninterrupted_run(consumed: int) -> None:
    # 5 micro-batches per epoch: consumed=4, 5, 6 resume right before, at and after the
    # epoch boundary, and the 8 batches compared always cross one.
    text = PackedTokens.from_documents(synthetic_corpus(num_documents=30), ByteTokenizer())
    packed = PackedTokens(tokens=text.tokens[: 31 * 10 + 1], eos_id=257, num_documents=1)
    settings = dict(seq_len=31, micro_batch=2, seed=7)
    uninterrupted = TokenBatches(packed, **settings)
    assert uninterrupted.batches_per_epoch == 5
    for _ in range(consumed):
        next(uninterrupted)
    state = uninterrupted.state_dict()
    assert all(type(value) is int for value in state.values())
    expected = [next(uninterrupted) for _ in range(8)]

    resumed = TokenBatches(packed, **settings)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # as it travels in a checkpoint
    for inputs, targets in expected:
        got_inputs, got_targets = next(resumed)
        assert torch.equal(got_inputs, inputs)
        assert torch.equal(got_targets, targets)


def test_load_state_dict_rejects_foreign_state(caplog: pytest.LogCaptureFixture) -> None:
    batches = TokenBatches(_counting_tokens(101), seq_len=10, micro_batch=2, seed=0)
    with pytest.raises(ValueError, match=r"missing \['position'\]"):
        batches.load_state_dict({"epoch": 1})
    with pytest.raises(
        ValueError, match=r"position=9 is out of range: an epoch has 5 micro-batches"
    ):
        batches.load_state_dict({"epoch": 1, "position": 9})
    with caplog.at_level(logging.WARNING, logger="memfit.train.data"):
        batches.load_state_dict({"epoch": 1, "position": 2, "seed": 3})
    assert "seed 3 -> 0" in caplog.text
    assert (batches.epoch, batches.position) == (1, 2)


@pytest.mark.parametrize("num_windows", [40, 43])
def test_ranks_see_disjoint_windows_that_cover_the_epoch(num_windows: int) -> None:
    seq_len, micro_batch, world_size = 5, 3, 2
    packed = _counting_tokens(num_windows * seq_len + 1)
    single = TokenBatches(packed, seq_len=seq_len, micro_batch=micro_batch, seed=11)
    single_epoch = [
        w for _ in range(single.batches_per_epoch) for w in _window_ids(next(single)[0], seq_len)
    ]
    per_rank = []
    for rank in range(world_size):
        batches = TokenBatches(
            packed,
            seq_len=seq_len,
            micro_batch=micro_batch,
            seed=11,
            rank=rank,
            world_size=world_size,
        )
        assert batches.batches_per_epoch == (num_windows // world_size) // micro_batch
        per_rank.append(
            [
                w
                for _ in range(batches.batches_per_epoch)
                for w in _window_ids(next(batches)[0], seq_len)
            ]
        )
    rank0, rank1 = set(per_rank[0]), set(per_rank[1])
    assert not rank0 & rank1
    assert len(rank0) == len(rank1)
    union = rank0 | rank1
    # Both slice the same permutation: together they take its first windows, in turn.
    assert union == set(single_epoch[: len(union)])
    assert num_windows - len(union) < world_size * micro_batch + world_size


def test_batch_settings_are_validated() -> None:
    packed = _counting_tokens(101)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\).*got 2"):
        TokenBatches(packed, seq_len=10, micro_batch=1, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match=r"micro_batch must be >= 1, got 0"):
        TokenBatches(packed, seq_len=10, micro_batch=0, seed=0)
    with pytest.raises(ValueError, match=r"gets 5 window\(s\).*micro_batch=6.*--seq-len"):
        TokenBatches(packed, seq_len=10, micro_batch=6, seed=0, rank=1, world_size=2)


def test_build_data_synthetic(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="memfit.train.data"):
        tokenizer, batches = build_data("synthetic", "byte", seq_len=64, micro_batch=4, seed=0)
    assert isinstance(tokenizer, ByteTokenizer)
    assert "4000 documents" in caplog.text
    inputs, targets = next(batches)
    assert inputs.shape == targets.shape == (4, 64)
    assert int(inputs.max()) < tokenizer.vocab_size
