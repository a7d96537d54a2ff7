"""QLoRA on a real checkpoint: SmolLM2-135M-Instruct (tests/real_model.py), its base's linear
layers in NF4, rank-8 adapters trained on real English text on CPU: the training loss falls and
so does the loss on held-out text of the same document."""

import math

import torch

from memfit.config import build_config
from memfit.train.engine import Trainer
from tests.real_model import english_text, smollm2_checkpoint


def held_out_loss(trainer: Trainer, ids: list[int], seq_len: int) -> float:
    """Mean next-token loss over the held-out tokens, in windows of seq_len + 1."""
    rows = torch.tensor(ids[: (len(ids) // (seq_len + 1)) * (seq_len + 1)]).view(-1, seq_len + 1)
    trainer.model.eval()
    with torch.no_grad():
        total = trainer.model(rows[:, :-1], targets=rows[:, 1:]).item()
    trainer.model.train()
    return total / rows[:, 1:].numel()


def test_qlora_on_a_real_checkpoint_lowers_the_loss(tmp_path):
    checkpoint = smollm2_checkpoint()
    text, _ = english_text()
    cut = int(len(text) * 0.85)
    (tmp_path / "train.txt").write_text(text[:cut])
    seq_len = 64
    trainer = Trainer(
        build_config(
            flags={
                "model": {"name": str(checkpoint)},
                "data": {"source": str(tmp_path / "train.txt"), "seq_len": seq_len},
                "train": {"steps": 10, "micro_batch": 2, "warmup_steps": 2, "device": "cpu",
                          "precision": "fp32", "lr": 1e-3},
                "checkpoint": {"out": str(tmp_path / "run")},
                "lora": {"rank": 8, "alpha": 16.0, "quantize": "nf4"},
            }
        )
    )  # fmt: skip
    held_out = trainer.tokenizer.encode(text[cut:])[: 3 * (seq_len + 1)]
    before = held_out_loss(trainer, held_out, seq_len)
    assert math.isfinite(before) and before < 5.0  # a trained model: far below ln(49152) = 10.8
    history = trainer.fit()
    first, last = sum(m.loss for m in history[:3]) / 3, sum(m.loss for m in history[-3:]) / 3
    after = held_out_loss(trainer, held_out, seq_len)
    assert last < first - 0.1, [m.loss for m in history]
    assert after < before - 0.05, (before, after)
