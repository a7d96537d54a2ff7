"""Activation checkpointing counted in FLOPs (torchtitan's test of its AC): what each mode
recomputes in backward, measured with torch.utils.flop_counter.FlopCounterMode over forward and
backward of a small model with SDPA attention on CPU.

FlopCounterMode counts matrix products and attention. Its attention formulas cover the CUDA
kernels of SDPA, not the one SDPA dispatches to on CPU (aten._scaled_dot_product_flash_attention
_for_cpu and its backward), so this file supplies their formulas; the exact values matter less
than counting the CPU kernel at all, without which full and selective would look the same.
"""

import pytest
import torch
from torch.utils.checkpoint import set_checkpoint_early_stop
from torch.utils.flop_counter import FlopCounterMode

from memfit.models.config import ModelConfig
from memfit.models.llama import build_model
from memfit.train.checkpointing import apply_activation_checkpointing

aten = torch.ops.aten
CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,  # GQA, as the presets
    intermediate_size=160,
    max_seq_len=64,
)
CPU_ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu


def attention_forward_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """q @ k^T and p @ v over every query head: 2 * b * h_q * s_q * s_k * (d + d_v)."""
    batch, heads, seqlen_q, head_dim = query
    seqlen_k, value_dim = key[2], value[3]
    return 2 * batch * heads * seqlen_q * seqlen_k * (head_dim + value_dim)


def attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Scores recomputed, then dp = do @ v^T, dv = p^T @ do, dq = ds @ k, dk = ds^T @ q."""
    batch, heads, seqlen_q, head_dim = query
    seqlen_k, value_dim = key[2], value[3]
    return 2 * batch * heads * seqlen_q * seqlen_k * (3 * head_dim + 2 * value_dim)


COUNT_CPU_ATTENTION = {
    CPU_ATTENTION: attention_forward_flops,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: attention_backward_flops,
}


def tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 49), generator=torch.Generator().manual_seed(0))


def count(mode: str, *, backward: bool = True, blocks: int | None = None) -> FlopCounterMode:
    """FLOPs of one forward (and backward) of the model checkpointed in `mode` (the first
    `blocks` blocks)."""
    model = build_model(CONFIG, attention="sdpa", seed=0)
    apply_activation_checkpointing(model, mode, blocks=blocks)
    batch = tokens()
    with FlopCounterMode(display=False, custom_mapping=COUNT_CPU_ATTENTION) as counter:
        loss = model(batch[:, :-1], batch[:, 1:])
        if backward:
            loss.backward()
    return counter


def per_block(counter: FlopCounterMode, suffix: str = "", op=None) -> int:
    """FLOPs counted inside model.layers[i]<suffix>, summed over the blocks (one op, or all)."""
    counts = counter.get_flop_counts()
    total = 0
    for index in range(CONFIG.num_layers):
        ops = counts.get(f"Llama.layers.{index}{suffix}", {})
        total += sum(n for o, n in ops.items() if op is None or o is op)
    return total


@pytest.fixture(scope="module")
def forward_only() -> FlopCounterMode:
    return count("none", backward=False)


def test_sdpa_on_cpu_runs_the_kernel_selective_saves(forward_only):
    """The policy of train/checkpointing.py names the op SDPA dispatches to here, and the
    counter sees it: an attention forward per block."""
    from memfit.train.checkpointing import _ATTENTION_OPS

    assert CPU_ATTENTION.default in _ATTENTION_OPS
    attention = per_block(forward_only, op=CPU_ATTENTION)
    assert attention > 0
    assert attention == CONFIG.num_layers * attention_forward_flops(
        (2, CONFIG.num_heads, 48, CONFIG.head_dim),
        (2, CONFIG.num_kv_heads, 48, CONFIG.head_dim),
        (2, CONFIG.num_kv_heads, 48, CONFIG.head_dim),
    )


def test_full_checkpointing_reruns_the_blocks_forward(forward_only):
    """full = none + one forward of every block, in torch's default (early-stopping) recompute
    less each block's last matrix product: recomputation stops once the last tensor backward
    needs exists, and the MLP's down projection only feeds the residual add. Without early
    stopping, exactly one more forward of the blocks."""
    none = count("none").get_total_flops()
    blocks = per_block(forward_only)
    down = per_block(forward_only, ".mlp.down")
    assert blocks > down > 0
    assert count("full").get_total_flops() == none + blocks - down
    with set_checkpoint_early_stop(False):
        assert count("full").get_total_flops() == none + blocks


def test_selective_checkpointing_does_not_recompute_attention(forward_only):
    """selective = full - the attention forward of every block: its outputs are saved, the rest
    of the block is recomputed."""
    attention = per_block(forward_only, op=CPU_ATTENTION)
    full = count("full")
    selective = count("selective")
    assert selective.get_total_flops() == full.get_total_flops() - attention
    # the attention kernel ran once per block (forward only), the matrix products as in full
    assert per_block(selective, op=CPU_ATTENTION) == attention
    assert per_block(full, op=CPU_ATTENTION) == 2 * attention
    assert per_block(selective, op=aten.mm) == per_block(full, op=aten.mm)


def test_checkpointing_some_blocks_reruns_only_those(forward_only):
    """blocks=N: the first N blocks rerun as in full, the others as without checkpointing; 0 is
    none and every block is full."""
    none = count("none")
    with set_checkpoint_early_stop(False):
        full = count("full")
        for blocks in range(CONFIG.num_layers + 1):
            partial = count("full", blocks=blocks)
            for index in range(CONFIG.num_layers):
                like = full if index < blocks else none
                suffix = f"Llama.layers.{index}"
                assert partial.get_flop_counts()[suffix] == like.get_flop_counts()[suffix]
            extra = blocks * per_block(forward_only) // CONFIG.num_layers
            assert partial.get_total_flops() == none.get_total_flops() + extra


def test_checkpointing_blocks_beyond_the_model_are_refused():
    model = build_model(CONFIG, attention="sdpa", seed=0)
    with pytest.raises(ValueError, match=r"checkpoint blocks = 4: the model has 3 blocks"):
        apply_activation_checkpointing(model, "full", blocks=4)
