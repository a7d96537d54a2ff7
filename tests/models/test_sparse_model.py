"""A model whose layers attend with a sparse pattern (ModelConfig.attention_pattern): a band
through the block-sparse kernel equals Mistral-style sliding-window attention, on the kernels
(Triton's interpreter) and on the plain path; a plain local pattern runs as a sliding window,
generation included; a strided pattern generates through the paged engine; the pattern applies
to the layers named; `memfit train` takes it from flags and TOML, records it in the checkpoint
and refuses a bad one."""

import contextlib
import dataclasses
import json
import re

import pytest
import torch

from memfit.cli.main import main
from memfit.models import PRESETS, build_model
from memfit.ops._triton import HAS_TRITON, triton_on_cpu


def model_of(config):
    return build_model(config, seed=0, attention="sdpa")


@pytest.mark.parametrize(
    "kernels",
    [False, pytest.param(True, marks=pytest.mark.skipif(not HAS_TRITON, reason="triton"))],
)
def test_a_band_through_the_sparse_kernel_is_sliding_window_attention(kernels):
    """strided:64:window=12 at 50 tokens is a causal band of 12 (its first summary column lies
    past the sequence), run by memfit.sparse_attention, not as a window."""
    base = dataclasses.replace(PRESETS["tiny"], max_seq_len=64)
    window = dataclasses.replace(base, sliding_window=12)
    sparse = dataclasses.replace(base, attention_pattern="strided:64:window=12")
    tokens = torch.randint(0, base.vocab_size, (2, 50), generator=torch.Generator().manual_seed(0))
    reference, model = model_of(window), model_of(sparse)
    model.load_state_dict(reference.state_dict())
    assert all(block.attention.pattern is not None for block in model.layers)
    with triton_on_cpu() if kernels else torch.no_grad():
        torch.testing.assert_close(model(tokens), reference(tokens), rtol=1e-4, atol=1e-4)


def test_the_pattern_applies_to_the_layers_named():
    config = dataclasses.replace(
        PRESETS["tiny"], attention_pattern="longformer:8:globals=0", pattern_layers="odd"
    )
    model = model_of(config)
    assert [block.attention.pattern is not None for block in model.layers] == [
        False, True, False, True,
    ]  # fmt: skip
    assert config.sparse_layer_indices() == (1, 3)
    with pytest.raises(ValueError, match="generating from such a model"):
        from memfit.inference import KVCache

        cache = KVCache(config, batch_size=1, max_seq_len=16, dtype=torch.float32, device="cpu")
        model(torch.zeros(1, 4, dtype=torch.long), kv_cache=cache)


def test_train_takes_the_pattern_and_records_it(tmp_path):
    run = tmp_path / "run"
    args = [
        "train", "--device", "cpu", "--steps", "2", "--seq-len", "64", "--micro-batch", "2",
        "--attention-pattern", "bigbird:16:globals=0:random=1:block=16", "--pattern-layers",
        "0,2", "--out", str(run),
    ]  # fmt: skip
    assert main(args) == 0
    meta = json.loads(next((run / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["model"]["attention_pattern"] == "bigbird:16:globals=0:random=1:block=16"
    assert meta["model"]["pattern_layers"] == "0,2"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--attention-pattern", "local"], "attention pattern 'local' is not one of: local:W"),
        (["--pattern-layers", "odd"], "set model.attention_pattern too"),
        (["--attention-pattern", "local:8", "--pattern-layers", "9"], "layer indices in"),
        (["--attention-pattern", "local:300"], r"window \(299, 0\) reaches past the sequence"),
    ],
)
def test_bad_patterns_are_refused_before_training(tmp_path, capsys, flags, message):
    args = ["train", "--device", "cpu", "--steps", "1", "--seq-len", "64", "--out", str(tmp_path)]
    assert main(args + flags) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert re.search(message, err), err


def test_a_local_pattern_generates_as_a_sliding_window_model():
    """local:W on every layer runs as sliding-window attention, decode included: a static-cache
    generation equals the sliding-window model's; with the pattern on some layers only, the
    static cache (one window for all) refuses and names the paged engine."""
    from memfit.inference.generate import generate

    base = dataclasses.replace(PRESETS["tiny"], max_seq_len=64)
    reference = model_of(dataclasses.replace(base, sliding_window=6))
    model = model_of(dataclasses.replace(base, attention_pattern="local:6"))
    model.load_state_dict(reference.state_dict())
    assert all(b.attention.window == 6 and b.attention.pattern is None for b in model.layers)
    prompt = torch.randint(0, base.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    want = generate(reference, prompt, max_new_tokens=12).tokens
    assert generate(model, prompt, max_new_tokens=12).tokens == want
    some = model_of(dataclasses.replace(base, attention_pattern="local:6", pattern_layers="odd"))
    with pytest.raises(ValueError, match="decode with the paged engine"):
        generate(some, prompt, max_new_tokens=2)


def test_model_configs_refuse_what_a_causal_lm_cannot_take_and_export_what_hf_can():
    from memfit.models.config import to_hf_config

    base = PRESETS["tiny"]
    with pytest.raises(ValueError, match="lets tokens see later ones"):
        dataclasses.replace(base, attention_pattern="local:8:bidirectional")
    with pytest.raises(ValueError, match="slides a window of 8 on every layer"):
        dataclasses.replace(base, sliding_window=8, attention_pattern="local:4")
    local = to_hf_config(dataclasses.replace(base, attention_pattern="local:8"))
    assert local["model_type"] == "mistral" and local["sliding_window"] == 8
    with pytest.raises(ValueError, match="has no equivalent"):
        to_hf_config(dataclasses.replace(base, attention_pattern="longformer:8:globals=0"))


def test_a_checkpoint_from_before_the_pattern_fields_still_matches(tmp_path):
    from memfit.train.checkpoint import check_model_matches

    config = PRESETS["tiny"]
    meta = {"model": {k: v for k, v in dataclasses.asdict(config).items()
                      if k not in ("attention_pattern", "pattern_layers")}}  # fmt: skip
    check_model_matches(meta, config, tmp_path)


def test_a_hugging_face_checkpoint_trains_with_a_pattern(tmp_path):
    """--attention-pattern on a Hugging Face checkpoint: its weights, the run's pattern."""
    from memfit.config import build_config
    from memfit.models import load_pretrained
    from memfit.train.engine import Trainer
    from tests.models.test_loading import _write_checkpoint, _write_tokenizer

    base = tmp_path / "base"
    _write_checkpoint(base)
    _write_tokenizer(base)
    spec = "longformer:8:globals=0"
    model, info = load_pretrained(
        base, device="cpu", dtype=torch.float32, config_changes={"attention_pattern": spec}
    )
    assert info.config.attention_pattern == spec
    assert all(block.attention.pattern is not None for block in model.layers)
    dense, _ = load_pretrained(base, device="cpu", dtype=torch.float32)
    tokens = torch.randint(0, 6, (1, 40), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(model(tokens), dense(tokens))  # (40 tokens: past the window)
    assert torch.allclose(model(tokens[:, :8]), dense(tokens[:, :8]), atol=1e-6)
    trainer = Trainer(build_config(flags={
        "model": {"name": str(base), "attention_pattern": spec},
        "data": {"seq_len": 32},
        "train": {"steps": 1, "micro_batch": 2, "device": "cpu", "precision": "fp32"},
        "checkpoint": {"out": str(tmp_path / "run")},
    }))  # fmt: skip
    assert all(block.attention.pattern is not None for block in trainer.model.layers)
    assert trainer.model_config.attention_pattern == spec
    assert torch.isfinite(torch.tensor(trainer.train_step().loss))


@pytest.mark.parametrize(
    "kernels, num_blocks",
    [
        (False, 40),
        (False, 7),  # (a pool small enough that the engine preempts)
        pytest.param(True, 7, marks=pytest.mark.skipif(not HAS_TRITON, reason="triton")),
    ],
)
def test_a_strided_pattern_generates_with_the_paged_engine(kernels, num_blocks):
    """strided:S:window=W decodes through the paged engine (its kernels read the window's and
    the summary columns' keys; the plain path masks the same): greedy tokens equal a full
    recompute through the block-sparse path, with chunked prefill and summary columns inside
    and before the window; the static cache refuses and names the paged engine."""
    from memfit.inference import Engine, PagedKVCache, SamplingParams
    from memfit.inference.generate import generate
    from tests.inference.test_engine import full_recompute

    config = dataclasses.replace(
        PRESETS["tiny"], max_seq_len=64, attention_pattern="strided:4:window=3"
    )
    model = model_of(config).eval()
    assert all(b.attention.paged_rule == (3, 4) for b in model.layers)
    generator = torch.Generator().manual_seed(2)
    batch = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist()
             for n in (3, 13, 9)]  # fmt: skip
    want = [full_recompute(model, prompt, 8) for prompt in batch]
    cache = PagedKVCache(
        config, num_blocks=num_blocks, block_size=4, dtype=torch.float32, device="cpu"
    )
    engine = Engine(model, cache, max_step_tokens=6)
    for prompt in batch:
        engine.add(prompt, SamplingParams(max_tokens=8))
    with triton_on_cpu() if kernels else contextlib.nullcontext():
        assert engine.run() == want
    assert (engine.preemptions > 0) == (num_blocks == 7)
    with pytest.raises(ValueError, match="decode with the paged engine"):
        generate(model, torch.tensor([batch[0]]), max_new_tokens=2)
