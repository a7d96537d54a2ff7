"""The end of a captured decode step (memfit.ops.greedy_advance): the Triton kernel, on CPU under
the interpreter and compiled where there is a GPU, against torch.argmax and a hand-computed
advance, on odd vocabularies that split over several programs; ties, NaN and padding rows; and
its scratch state left reset, so that the next step finds it clean."""

import contextlib

import pytest
import torch

from memfit.ops._triton import interpreter_enabled, triton_on_cpu
from memfit.ops.greedy_advance import argmax_scratch, greedy_advance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCABS = [5, 4097, 9000] + ([128256, 151936] if DEVICE == "cuda" else [])


def rows_for(batch: int, positions: list[int], live: list[int], greedy: list[int], block_size):
    rows = torch.zeros(6, batch + 3, dtype=torch.long)  # wider than the batch, as a bucket's
    rows[0, :batch] = -7
    rows[1, :batch] = torch.tensor(positions)
    rows[2, :batch] = -1  # (the slot before: overwritten for live rows)
    rows[3, :batch] = torch.tensor(positions) + 1
    rows[4, :batch] = torch.tensor(live)
    rows[5, :batch] = torch.tensor(greedy)
    return rows


def expected(rows, logits, table, block_size):
    rows = rows.clone()
    for r in range(logits.shape[0]):
        if rows[5, r]:
            rows[0, r] = logits[r].float().nan_to_num(nan=float("-inf")).argmax()
        if rows[4, r]:
            p = int(rows[1, r]) + 1
            rows[1, r], rows[3, r] = p, p + 1
            rows[2, r] = int(table[r, min(p // block_size, table.shape[1] - 1)]) * block_size
            rows[2, r] += p % block_size
    return rows


@pytest.fixture(params=["triton", "torch"])
def path(request):
    if request.param == "triton" and DEVICE == "cpu" and not interpreter_enabled():
        pytest.skip("the kernel on CPU needs TRITON_INTERPRET=1")
    context = (
        triton_on_cpu()
        if request.param == "triton" and DEVICE == "cpu"
        else contextlib.nullcontext()
    )
    with context:
        yield request.param


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", VOCABS)
def test_argmax_and_advance(path, vocab, dtype):
    if path == "torch" and DEVICE == "cuda":
        pytest.skip("the torch path serves CPU tensors without the kernels")
    generator = torch.Generator().manual_seed(vocab)
    batch, block_size = 5, 4
    logits = torch.randn(batch, vocab, generator=generator).to(dtype)
    top = logits.float().max()
    logits[1, vocab // 2] = top + 1  # a tie between two slices: the first index wins
    logits[1, vocab - 1] = top + 1
    logits[2, :] = float("-inf")
    logits[2, vocab - 1] = -1e30  # the only finite logit is the last
    logits[3, 0] = float("nan")  # NaN is passed over
    table = torch.randint(0, 50, (batch, 4), generator=generator, dtype=torch.int32)
    positions = [0, 3, 7, 14, 15]  # 3 and 7 cross into the next block; 15: the last column
    rows = rows_for(batch, positions, live=[1, 1, 1, 1, 0], greedy=[1, 1, 1, 1, 1], block_size=4)
    rows[5, 0] = 0  # a row that samples: its token stays
    want = expected(rows, logits, table, block_size)
    scratch = argmax_scratch(batch + 3, torch.device(DEVICE))
    clean = scratch.clone()
    for step in range(2):  # the second call finds the scratch reset by the first
        got = rows.clone().to(DEVICE)
        greedy_advance(logits.to(DEVICE), got, table.to(DEVICE), block_size, scratch)
        assert torch.equal(got.cpu(), want), step
        assert torch.equal(scratch, clean)
    assert int(want[0, 1]) == vocab // 2 and int(want[0, 2]) == vocab - 1
    assert int(want[0, 0]) == -7 and int(want[1, 4]) == 15  # untouched rows
