"""LoRA (memfit.nn.lora): an adapted model starts equal to its base; only the adapters get
gradients; per-projection adapters on the fused qkv and gate_up equal separate q/k/v/gate/up
adapters; merging equals the adapted model; adapters go to and come from peft's format, and
transformers + peft give the same logits."""

import json

import pytest
import torch

from memfit.models import build_model, load_pretrained
from memfit.models.config import PRESETS
from memfit.nn.lora import (
    LINEAR_NAMES,
    LoRALinear,
    LoRASpec,
    apply_lora,
    load_peft_adapter,
    lora_layers,
    merge_lora,
    read_peft_config,
    save_peft_adapter,
)
from tests.models.test_loading import TINY  # (a tiny Llama config for transformers)


def _model(seed=0):
    return build_model(PRESETS["tiny"], device="cpu", attention="sdpa", seed=seed).eval()


def _randomize_b(model, seed=1):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in lora_layers(model).values():
            for b in layer.lora_B.values():
                b.normal_(0, 0.05, generator=generator)


def _tokens(vocab, shape=(2, 11), seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_a_new_adapter_leaves_the_outputs_unchanged_and_only_adapters_train():
    model = _model()
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        before = model(tokens)
    layers = apply_lora(model, LoRASpec(rank=4, alpha=8, dropout=0.1))
    assert set(layers) == {
        f"layers.{i}.{m}" for i in range(model.config.num_layers)
        for m in ("attention.qkv", "attention.out", "mlp.gate_up", "mlp.down")
    }  # fmt: skip
    with torch.no_grad():
        assert torch.equal(model(tokens), before)  # (eval: no dropout)
    model.train()
    loss = model(tokens, tokens)
    loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    for name, param in model.named_parameters():
        if ".lora_" in name:
            assert param.grad is not None and param.dtype == torch.float32
        else:
            assert param.grad is None
    # B is zero: A gets no gradient at first, B does
    qkv = model.layers[0].attention.qkv
    assert all(torch.count_nonzero(b.grad) > 0 for b in qkv.lora_B.values())


def test_fused_projections_take_one_adapter_per_targeted_part():
    """targets q_proj, v_proj, up_proj: qkv holds adapters on q and v only (k's rows get no
    update), gate_up on up only; each part's update is s B_i A_i x on its own rows."""
    model = _model()
    spec = LoRASpec(rank=3, alpha=6, targets=("q_proj", "v_proj", "up_proj"))
    apply_lora(model, spec)
    _randomize_b(model)
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = model.layers[1].attention.qkv
    assert isinstance(qkv, LoRALinear) and list(qkv.lora_A) == ["q_proj", "v_proj"]
    assert list(model.layers[1].mlp.gate_up.lora_A) == ["up_proj"]
    assert not isinstance(model.layers[1].mlp.down, LoRALinear)
    x = torch.randn(5, c.hidden_size, dtype=torch.float64)
    qkv.double()
    y = qkv(x)
    w = qkv.weight
    expected = x @ w.T
    for name, rows in (("q_proj", slice(0, q)), ("v_proj", slice(q + kv, q + 2 * kv))):
        expected[:, rows] += spec.scale * x @ qkv.lora_A[name].T @ qkv.lora_B[name].T
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(y[:, q : q + kv], x @ w[q : q + kv].T)  # k untouched


def test_rslora_scale_and_bad_specs():
    assert LoRASpec(rank=16, alpha=32).scale == 2.0
    assert LoRASpec(rank=16, alpha=32, rslora=True).scale == 8.0
    with pytest.raises(ValueError, match="unknown LoRA target 'qkv'.*q_proj"):
        LoRASpec(rank=4, targets=("qkv",))
    with pytest.raises(ValueError, match="rank must be >= 1"):
        LoRASpec(rank=0)
    with pytest.raises(ValueError, match="dropout must be in"):
        LoRASpec(rank=4, dropout=1.0)
    model = _model()
    apply_lora(model, LoRASpec(rank=2, targets=("o_proj",)))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, LoRASpec(rank=2))


def test_merging_equals_the_adapted_model():
    model = _model()
    apply_lora(model, LoRASpec(rank=4, alpha=16, targets=("all-linear",)))
    _randomize_b(model)
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        adapted = model(tokens)
    merge_lora(model)
    assert not lora_layers(model) and not hasattr(model, "lora_spec")
    assert set(model.state_dict()) == set(_model().state_dict())
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), adapted, rtol=1e-5, atol=1e-5)


def test_a_bf16_base_with_fp32_adapters_runs_without_autocast():
    model = _model()
    apply_lora(model, LoRASpec(rank=4))
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            param.data = param.data.to(torch.bfloat16)
    x = torch.randn(3, model.config.hidden_size, dtype=torch.bfloat16)
    assert model.layers[0].mlp.down(model.layers[0].mlp.gate_up(x, swiglu=True)).dtype == (
        torch.bfloat16
    )


# -- peft's format, and transformers + peft ---------------------------------------------------


def _transformers_checkpoint(directory):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model("llama", **TINY)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.save_pretrained(directory)
    return model.float().eval()


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj", "down_proj")])
def test_memfit_adapters_load_in_peft_with_the_same_logits(tmp_path, targets):
    peft = pytest.importorskip("peft")
    hf_model = _transformers_checkpoint(tmp_path / "base")
    model, _ = load_pretrained(tmp_path / "base", device="cpu", dtype=torch.float32)
    apply_lora(model, LoRASpec(rank=4, alpha=12, targets=targets, rslora=True))
    _randomize_b(model)
    save_peft_adapter(model, tmp_path / "adapter", base=str(tmp_path / "base"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["use_rslora"] and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) == set(
        LINEAR_NAMES if targets == ("all-linear",) else targets
    )
    peft_model = peft.PeftModel.from_pretrained(hf_model, tmp_path / "adapter").eval()
    tokens = _tokens(TINY["vocab_size"], (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), peft_model(tokens).logits, rtol=1e-4, atol=2e-5)


def test_peft_adapters_load_in_memfit_with_the_same_logits(tmp_path):
    peft = pytest.importorskip("peft")
    hf_model = _transformers_checkpoint(tmp_path / "base")
    lora = peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "gate_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )  # fmt: skip
    peft_model = peft.get_peft_model(hf_model, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft_model.save_pretrained(tmp_path / "adapter")
    peft_model.eval()
    model, _ = load_pretrained(tmp_path / "base", device="cpu", dtype=torch.float32)
    spec = load_peft_adapter(model, tmp_path / "adapter")
    assert spec.names == ("q_proj", "k_proj", "o_proj", "gate_proj") and spec.scale == 2.0
    tokens = _tokens(TINY["vocab_size"], (2, 9), seed=3)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), peft_model(tokens).logits, rtol=1e-4, atol=2e-5)


def test_an_adapter_of_another_model_is_refused_and_the_model_stays_its_base(tmp_path):
    model = _model()
    apply_lora(model, LoRASpec(rank=4, targets=("q_proj",)))
    save_peft_adapter(model, tmp_path / "adapter")
    other = build_model(
        PRESETS["tiny"].replace(hidden_size=2 * PRESETS["tiny"].hidden_size), device="cpu"
    )
    other.requires_grad_(False)
    before = {name: id(p) for name, p in other.named_parameters()}
    with pytest.raises(ValueError, match="does not fit this model: .*lora_A.weight is"):
        load_peft_adapter(other, tmp_path / "adapter")
    assert not lora_layers(other) and not hasattr(other, "lora_spec")
    assert {name: id(p) for name, p in other.named_parameters()} == before  # the same tensors
    assert not any(p.requires_grad for p in other.parameters())
    (tmp_path / "adapter" / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "use_dora": True})
    )
    with pytest.raises(ValueError, match="cannot apply an adapter with use_dora"):
        read_peft_config(tmp_path / "adapter")
