"""to_hf_config: a memfit model's config.json for transformers (what `memfit export` writes), for
Llama, Mistral (a window), Qwen2 (qkv biases) and Qwen2 with a window: transformers built from
it with memfit's weights gives memfit's logits."""

import pytest
import torch

from memfit.models import build_model
from memfit.models.config import ModelConfig, to_hf_config
from memfit.models.llama import to_hf_state_dict

BASE = {"vocab_size": 97, "hidden_size": 48, "num_layers": 2, "num_heads": 6, "num_kv_heads": 2,
        "intermediate_size": 80, "max_seq_len": 64}  # fmt: skip
CASES = {
    "llama-tied": ({"tie_embeddings": True}, "llama"),
    "mistral-window": ({"sliding_window": 5}, "mistral"),
    "qwen2-bias": ({"qkv_bias": True}, "qwen2"),
    "qwen2-bias-window": ({"qkv_bias": True, "sliding_window": 5}, "qwen2"),
}


@pytest.mark.parametrize("case", CASES)
def test_transformers_reads_the_config_and_gives_the_same_logits(case):
    transformers = pytest.importorskip("transformers")
    changes, model_type = CASES[case]
    model = build_model(ModelConfig(**BASE, **changes), device="cpu", seed=0).eval()
    with torch.no_grad():  # biases start at zero: make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0, 0.1)
    hf_config = to_hf_config(model.config, "float32")
    assert hf_config["model_type"] == model_type
    config = transformers.AutoConfig.for_model(**hf_config)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.load_state_dict(to_hf_state_dict(model), strict=not model.config.tie_embeddings)
    tokens = torch.randint(0, 97, (2, 23))  # longer than the window
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(tokens).logits, model(tokens), rtol=1e-4, atol=2e-5)
