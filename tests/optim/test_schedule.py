"""The default peak learning rate by model size (memfit.optim.default_lr) and the run that
takes it when none is given."""

import json
import logging

import pytest

from memfit.config import build_config
from memfit.models.config import PRESETS
from memfit.optim import default_lr
from memfit.train.engine import Trainer, default_run_dir


def test_the_default_learning_rate_falls_with_the_model_size():
    assert default_lr(PRESETS["tiny"].num_params) == 3e-3  # the tiny preset keeps its 3e-3
    sizes = [PRESETS[n].num_params for n in ("llama-3.2-1b", "llama-3.2-3b", "llama-3-8b")]
    rates = [default_lr(n) for n in sizes]
    assert rates == sorted(rates, reverse=True)
    # about where published pretraining runs of these sizes sit
    assert default_lr(125e6) == pytest.approx(6e-4, rel=0.01)
    assert rates[0] == pytest.approx(2.8e-4, rel=0.05)
    assert rates[2] == pytest.approx(1.5e-4, rel=0.05)


def _trainer(tmp_path, model, **train):
    flags = {
        "model": {"name": model},
        "data": {"seq_len": 32},
        "train": {"steps": 2, "micro_batch": 1, "device": "cpu", "precision": "fp32", **train},
        "checkpoint": {"out": str(tmp_path / "run")},
    }
    return Trainer(build_config(flags=flags))


def test_a_run_without_lr_takes_the_default_for_its_model(tmp_path, caplog):
    from tests.models.test_llama import _tiny_hf_config

    path = tmp_path / "wider.json"  # about 8M parameters: half of tiny's rate
    config = _tiny_hf_config(
        "llama", hidden_size=256, intermediate_size=704, num_hidden_layers=4, vocab_size=16384,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
    )  # fmt: skip
    path.write_text(json.dumps(config))
    with caplog.at_level(logging.INFO, logger="memfit"):
        trainer = _trainer(tmp_path, str(path))
    expected = default_lr(trainer.model_config.num_params)
    assert expected < 2e-3
    assert trainer.config.train.lr == expected
    assert {group["initial_lr"] for group in trainer.optimizer.param_groups} == {expected}
    assert "by the model's size" in caplog.text
    # an explicit --lr wins, and the tiny preset keeps 3e-3
    assert _trainer(tmp_path / "b", str(path), lr=1e-2).config.train.lr == 1e-2
    assert _trainer(tmp_path / "c", "tiny").config.train.lr == 3e-3


def test_run_directories_keep_dotted_model_names():
    assert default_run_dir("meta-llama/Llama-3.2-1B").startswith("runs/Llama-3.2-1B-")
    assert default_run_dir("configs/my-llama-3.2.json").startswith("runs/my-llama-3.2-")
    assert default_run_dir("tiny").startswith("runs/tiny-")
