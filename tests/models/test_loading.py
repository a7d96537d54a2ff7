"""load_pretrained: checkpoints saved by transformers (one file and sharded; Llama, Mistral with a
sliding window, Qwen2 with qkv biases, tied embeddings) give transformers' logits; a bf16 load
never makes a float32 tensor; memfit training checkpoints load; the tokenizer and generation
defaults are read; every broken checkpoint is refused with the problem named."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.models import ModelConfig, build_model, from_hf_config, load_pretrained
from memfit.models.llama import to_hf_state_dict
from memfit.train.checkpoint import CheckpointError, save_checkpoint
from tests.reference import assert_error_within

TINY = {
    "vocab_size": 97,
    "hidden_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "intermediate_size": 80,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
}

# model_type, config changes, max_shard_size (a size forces an index and several shards)
TIED_MQA = {"tie_word_embeddings": True, "num_key_value_heads": 1}
CASES = {
    "llama": ("llama", {}, None),
    "llama-tied-mqa-sharded": ("llama", TIED_MQA, "20KB"),
    "mistral-window-sharded": ("mistral", {"sliding_window": 5}, "20KB"),
    "qwen2-qkv-bias": ("qwen2", {}, None),
}


def _save_transformers_model(directory, case, dtype=torch.float32):
    """A tiny random transformers model of `case`, saved by save_pretrained; returned in fp32."""
    transformers = pytest.importorskip("transformers")
    model_type, changes, max_shard_size = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **(TINY | changes))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # transformers starts norms at 1 and biases at 0: make them count
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(directory, **kwargs)
    return model.float().eval()


@pytest.mark.parametrize("case", CASES)
def test_fp32_load_gives_transformers_logits(tmp_path, case):
    hf_model = _save_transformers_model(tmp_path, case)
    if CASES[case][2]:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
        assert "lm_head.weight" not in index["weight_map"] or "tied" not in case
    model, info = load_pretrained(tmp_path, device="cpu", dtype=torch.float32)
    assert info.format == "huggingface" and info.config.tie_embeddings == ("tied" in case)
    assert info.config.sliding_window == CASES[case][1].get("sliding_window")
    tokens = torch.randint(0, TINY["vocab_size"], (2, 23))  # longer than the window of 5
    with torch.no_grad():
        expected = hf_model(tokens).logits
        actual = model(tokens)
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("case", CASES)
def test_bf16_load_is_bf16_throughout_and_as_accurate_as_transformers_in_bf16(tmp_path, case):
    hf_model = _save_transformers_model(tmp_path, case)
    model, info = load_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16)
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    assert info.dtype == torch.bfloat16
    assert {name: t.dtype for name, t in tensors.items()} == dict.fromkeys(tensors, torch.bfloat16)
    assert all(t.device.type == "cpu" for t in tensors.values())
    tokens = torch.randint(0, TINY["vocab_size"], (2, 23))
    with torch.no_grad():
        exact = hf_model(tokens).logits
        baseline = hf_model.to(torch.bfloat16)(tokens).logits
        actual = model(tokens)
    assert actual.dtype == torch.bfloat16
    assert_error_within(actual, baseline, exact, name=f"{case} bf16 logits")


class _Float32TensorsMade(TorchDispatchMode):
    """Records every float32 tensor an operation returns, off the meta device."""

    def __init__(self):
        super().__init__()
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                if not tensor.is_meta:
                    self.made.append((str(func), tuple(tensor.shape)))
        return out


def test_bf16_checkpoint_loads_without_making_any_float32_tensor(tmp_path):
    _save_transformers_model(tmp_path, "llama-tied-mqa-sharded", dtype=torch.bfloat16)
    with _Float32TensorsMade() as probe:
        load_pretrained(tmp_path, device="cpu", dtype=torch.bfloat16)
    assert probe.made == []
    # the probe does see the float32 tensors of a model allocated before it is cast
    with _Float32TensorsMade() as probe:
        build_model(from_hf_config(tmp_path), device="cpu").to(torch.bfloat16)
    assert len(probe.made) > 10


# -- memfit training checkpoints --------------------------------------------------------------


def _memfit_run(run_dir) -> torch.nn.Module:
    config = ModelConfig(
        name="tiny-test",
        vocab_size=258,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_seq_len=64,
    )
    model = build_model(config, seed=3).eval()
    for step in (5, 6):
        save_checkpoint(
            run_dir,
            step=step,
            model=model,
            model_config=config,
            trainer_state={},
            config_toml="",
            tokenizer="byte",
        )
    return model


def test_memfit_training_checkpoint_loads_in_any_dtype(tmp_path):
    trained = _memfit_run(tmp_path / "run")
    model, info = load_pretrained(tmp_path / "run", device="cpu", dtype=torch.float32)
    assert (info.format, info.step, info.path.name) == ("memfit", 6, "step_0000006")
    assert (info.tokenizer.eos_id, info.generation.eos_token_ids) == (257, (257,))
    tokens = torch.randint(0, 258, (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), trained(tokens), rtol=0, atol=0)

    model, info = load_pretrained(info.path, device="cpu", dtype=torch.bfloat16)  # a step dir
    for name, tensor in trained.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_partial_memfit_checkpoint_is_refused(tmp_path):
    _memfit_run(tmp_path / "run")
    weights = tmp_path / "run" / "checkpoints" / "step_0000006" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors has .* bytes"):
        load_pretrained(tmp_path / "run" / "checkpoints" / "step_0000006", device="cpu")


# -- tokenizer and generation defaults --------------------------------------------------------


def _write_checkpoint(directory, *, shards=1, **changes):
    """A Llama checkpoint in Hugging Face's layout, written from a seeded memfit model (no
    transformers needed): config.json and one safetensors file, or `shards` and an index."""
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"} | TINY | changes))
    weights = {
        name: tensor.clone()
        for name, tensor in to_hf_state_dict(build_model(from_hf_config(directory))).items()
    }
    if shards == 1:
        save_file(weights, directory / "model.safetensors")
        return
    names = sorted(weights)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: weights[name] for name in names[shard::shards]}
        save_file(part, directory / file)
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_sharded_and_single_file_checkpoints_load_the_same_weights(tmp_path):
    _write_checkpoint(tmp_path / "one")
    _write_checkpoint(tmp_path / "three", shards=3)
    one, _ = load_pretrained(tmp_path / "one", device="cpu", dtype=torch.float32)
    three, _ = load_pretrained(tmp_path / "three", device="cpu", dtype=torch.float32)
    written = build_model(from_hf_config(tmp_path / "one")).state_dict()
    for name, tensor in written.items():
        assert torch.equal(one.state_dict()[name], tensor), name
        assert torch.equal(three.state_dict()[name], tensor), name


def _write_tokenizer(directory, words=("hello", "world")) -> None:
    """A word-level tokenizer: the special tokens at 0-3, then `words` from id 4."""
    vocab = {"<s>": 0, "</s>": 1, "<|eot|>": 2, "[UNK]": 3}
    vocab |= {word: 4 + i for i, word in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<s>", "</s>", "<|eot|>"])
    tokenizer.save(str(directory / "tokenizer.json"))


def test_tokenizer_and_generation_defaults(tmp_path):
    _write_checkpoint(tmp_path)
    _write_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": {"content": "</s>", "special": True},  # an AddedToken
                "chat_template": "{% for m in messages %}{{ m.content }}<|eot|>{% endfor %}",
            }
        )
    )
    generation = {"bos_token_id": 0, "eos_token_id": [1, 2], "do_sample": True}
    generation |= {"temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    _, info = load_pretrained(tmp_path, device="cpu")

    tokenizer = info.tokenizer
    assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (6, 0, 1)
    assert tokenizer.encode("hello world") == [4, 5]
    assert tokenizer.encode_batch(["world", "hello hello"]) == [[5], [4, 4]]
    assert tokenizer.decode([0, 4, 5, 2, 1]) == "hello world"
    assert info.chat_template.endswith("<|eot|>{% endfor %}")
    assert (info.generation.eos_token_ids, info.generation.bos_token_id) == ((1, 2), 0)
    params = info.generation.sampling_params(max_tokens=8)
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 50, 0.9)  # transformers' 50
    assert (params.stop_token_ids, params.max_tokens) == ((1, 2), 8)
    assert params.repetition_penalty == 1.05

    (tmp_path / "generation_config.json").unlink()  # no ids anywhere but the tokenizer's
    _, info = load_pretrained(tmp_path, device="cpu")
    assert (info.generation.eos_token_ids, info.generation.bos_token_id) == ((1,), 0)
    assert info.generation.sampling_params().temperature == 0.0  # greedy, as transformers


def test_checkpoint_without_tokenizer_loads_without_one(tmp_path):
    _write_checkpoint(tmp_path, eos_token_id=2)
    _, info = load_pretrained(tmp_path, device="cpu")
    assert info.tokenizer is None and info.chat_template is None
    assert info.generation.eos_token_ids == (2,)


# -- refusals ---------------------------------------------------------------------------------


def _rewrite_weights(directory, edit) -> None:
    weights = load_file(directory / "model.safetensors")
    edit(weights)
    save_file(weights, directory / "model.safetensors")


def _edit_config(directory, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | changes))


def _no_weights(directory):
    (directory / "model.safetensors").unlink()


def _pickled_weights_only(directory):
    (directory / "model.safetensors").rename(directory / "pytorch_model.bin")


def _shard_absent(directory):
    (directory / "model-00002-of-00003.safetensors").unlink()


def _tensor_missing(directory):
    _rewrite_weights(directory, lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))


def _tensor_unexpected(directory):
    _rewrite_weights(directory, lambda w: w.update({"model.layers.0.mlp.scale": torch.ones(3)}))


def _shapes_differ(directory):
    _edit_config(directory, intermediate_size=96)


def _quantized_tensor(directory):
    name = "model.layers.0.self_attn.o_proj.weight"
    _rewrite_weights(directory, lambda w: w.update({name: w[name].to(torch.int8)}))


def _other_model_type(directory):
    _edit_config(directory, model_type="gpt2")


def _classifier(directory):
    _edit_config(directory, architectures=["LlamaForSequenceClassification"])


def _foreign_eos_token(directory):
    _write_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def _no_config(directory):
    (directory / "config.json").unlink()


BROKEN = [
    (_no_config, 1, FileNotFoundError, r"no config\.json"),
    (_no_weights, 1, FileNotFoundError, r"neither model\.safetensors nor"),
    (_pickled_weights_only, 1, FileNotFoundError, r"pytorch_model\.bin, which memfit does not"),
    (_shard_absent, 3, FileNotFoundError, r"1 of them .*: model-00002-of-00003\.safetensors"),
    (_tensor_missing, 1, ValueError, r"missing 1 tensor\(s\): model\.layers\.1\.mlp\.down_proj"),
    (_tensor_unexpected, 1, ValueError, r"1 unexpected tensor\(s\): model\.layers\.0\.mlp\.scale"),
    (_shapes_differ, 1, ValueError, r"gate_proj\.weight has shape \(80, 48\), .* \(96, 48\)"),
    (_quantized_tensor, 1, ValueError, r"o_proj\.weight \(I8\).* not quantized"),
    (_other_model_type, 1, ValueError, r"model_type='gpt2', which memfit does not support"),
    (_classifier, 1, ValueError, r"LlamaForSequenceClassification; .*causal language models"),
    (_foreign_eos_token, 1, ValueError, r"eos_token '<\|im_end\|>', which .* does not have"),
]  # fmt: skip


@pytest.mark.parametrize(
    "breaks,shards,error,message", BROKEN, ids=[b[0].__name__.strip("_") for b in BROKEN]
)
def test_broken_checkpoint_is_refused_naming_the_problem(tmp_path, breaks, shards, error, message):
    _write_checkpoint(tmp_path, shards=shards)
    breaks(tmp_path)
    with pytest.raises(error, match=message):
        load_pretrained(tmp_path, device="cpu")


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
        load_pretrained(tmp_path / "absent", device="cpu")
    _write_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="torch.bfloat16, torch.float16 or torch.float32"):
        load_pretrained(tmp_path, device="cpu", dtype=torch.float64)
    with pytest.raises(ValueError, match="attention='flash' cannot run here"):
        load_pretrained(tmp_path, device="cpu", attention="flash")


def test_a_tensor_left_on_the_meta_device_is_refused():
    """Checkpoints hold no non-persistent buffers (a rotary table, say); a model with one must
    make it after loading, and the loader refuses to hand the model out until it does."""
    from memfit.models.loading import _check_materialized

    module = torch.nn.Linear(2, 2)
    module.register_buffer("inv_freq", torch.empty(4, device="meta"), persistent=False)
    with pytest.raises(RuntimeError, match="inv_freq are still on the meta device"):
        _check_materialized(module)
