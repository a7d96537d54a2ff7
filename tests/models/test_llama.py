import json

import pytest
import torch

from memfit.models import (
    PRESETS,
    Llama,
    ModelConfig,
    build_model,
    from_hf_config,
    load_model_config,
)
from memfit.models.llama import load_hf_state_dict, to_hf_state_dict

# Parameter counts of the published checkpoints (their safetensors index totals).
PUBLISHED = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "mistral-7b": 7_241_732_096,
    "qwen2.5-7b": 7_615_616_512,
}


def test_llama_1b_has_953_2m_parameters():
    assert round(PRESETS["llama-1b"].num_params / 1e6, 1) == 953.2


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_counts_on_meta_device(name):
    with torch.device("meta"):
        model = Llama(PRESETS[name])
    counted = sum(p.numel() for p in model.parameters())
    assert counted == PRESETS[name].num_params == PUBLISHED[name]
    assert all(p.device.type == "meta" for p in model.parameters())


def _tiny_hf_config(model_type: str, **extra) -> dict:
    config = {
        "model_type": model_type,
        "vocab_size": 97,
        "hidden_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "intermediate_size": 80,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    config.update(extra)
    return config


def test_hf_config_reader(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_tiny_hf_config("qwen2", rope_theta=1e6)))
    config = from_hf_config(tmp_path)
    assert (config.hidden_size, config.num_kv_heads, config.head_dim) == (48, 2, 8)
    assert config.qkv_bias and config.rope_theta == 1e6
    assert load_model_config(str(path)) == config


def test_hf_config_unsupported_architecture(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="gpt2.*not support"):
        from_hf_config(path)


def test_unknown_preset_names_known_ones():
    with pytest.raises(ValueError, match="did you mean 'llama-1b'") as info:
        load_model_config("llama-1B")
    assert "tiny" in str(info.value)


def test_bad_head_counts_raise():
    with pytest.raises(ValueError, match="num_heads=6 is not a multiple of num_kv_heads=4"):
        ModelConfig(
            vocab_size=10,
            hidden_size=48,
            num_layers=1,
            num_heads=6,
            num_kv_heads=4,
            intermediate_size=8,
        )


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "num_key_value_heads": 1}),
        (
            "llama",
            {
                "rope_theta": 500000.0,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            },
        ),
        ("mistral", {"sliding_window": 7}),
        ("qwen2", {}),
    ],
)
def test_matches_hugging_face_outputs(tmp_path, model_type, extra):
    transformers = pytest.importorskip("transformers")
    hf_json = _tiny_hf_config(model_type, **extra)
    (tmp_path / "config.json").write_text(json.dumps(hf_json))
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path)
    hf_config._attn_implementation = "eager"
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    for p in hf_model.parameters():  # HF zero-initializes biases: make them count
        torch.nn.init.normal_(p, std=0.05) if p.ndim == 1 and p.shape[0] != 48 else None

    config = from_hf_config(tmp_path)
    model = build_model(config, attention="eager", seed=1).eval()
    load_hf_state_dict(model, {k: v for k, v in hf_model.state_dict().items() if "rotary" not in k})
    tokens = torch.randint(0, config.vocab_size, (2, 23))
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = model(tokens)
    # fp32 on both sides (HF's RMSNorm computes in fp32 even for fp64 models)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=2e-5)
    # round trip of names
    ours = to_hf_state_dict(model)
    for name, tensor in ours.items():
        torch.testing.assert_close(tensor, hf_model.state_dict()[name])


def test_loss_equals_cross_entropy_of_logits():
    config = PRESETS["tiny"]
    model = build_model(config, seed=0)
    tokens = torch.randint(0, config.vocab_size, (2, 19))
    targets = torch.randint(0, config.vocab_size, (2, 19))
    targets[0, :5] = -100
    logits = model(tokens)
    expected = torch.nn.functional.cross_entropy(
        logits.reshape(-1, config.vocab_size), targets.reshape(-1), reduction="sum"
    )
    torch.testing.assert_close(model(tokens, targets), expected, rtol=1e-5, atol=1e-5)


def test_sdpa_and_eager_attention_agree():
    config = PRESETS["tiny"].replace(sliding_window=5)
    tokens = torch.randint(0, config.vocab_size, (2, 17))
    eager = build_model(config, attention="eager", seed=3)
    sdpa = build_model(config, attention="sdpa", seed=3)
    torch.testing.assert_close(sdpa(tokens), eager(tokens), rtol=1e-5, atol=1e-5)


def test_a_config_file_names_the_model_by_its_directory_or_file(tmp_path, monkeypatch):
    """A config.json takes its directory's name (also as ./config.json), another file its own
    name less .json, dots kept; a hub config's _name_or_path wins."""
    directory = tmp_path / "Llama-3.2-1B"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(_tiny_hf_config("llama")))
    (directory / "my-llama-3.2.json").write_text(json.dumps(_tiny_hf_config("llama")))
    assert load_model_config(str(directory / "config.json")).name == "Llama-3.2-1B"
    assert load_model_config(str(directory / "my-llama-3.2.json")).name == "my-llama-3.2"
    monkeypatch.chdir(directory)
    assert load_model_config("config.json").name == "Llama-3.2-1B"
    named = _tiny_hf_config("llama", _name_or_path="meta-llama/Llama-3.2-1B")
    (directory / "config.json").write_text(json.dumps(named))
    assert load_model_config("config.json").name == "meta-llama/Llama-3.2-1B"
