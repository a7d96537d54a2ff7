"""The offline API over real checkpoints: a model saved by transformers generates, through the
paged engine, the greedy tokens of transformers' own model recomputed in full; text prompts,
stop strings, log-probs and the end-of-sequence tokens of generation_config.json; bad requests
fail before anything runs, with the numbers."""

import json

import pytest
import torch

from memfit.inference import LLM, SamplingParams
from tests.models.test_loading import TINY, _save_transformers_model
from tests.models.test_loading import _write_tokenizer as write_tokenizer


def _write_tokenizer(directory) -> None:
    """A word for every id of the tiny vocabulary."""
    write_tokenizer(directory, words=[f"w{i}" for i in range(4, TINY["vocab_size"])])


def hf_greedy(model, prompt, steps):
    """transformers' model, the whole sequence recomputed for each token: (tokens, logprobs)."""
    sequence, logprobs = torch.tensor([prompt]), []
    for _ in range(steps):
        with torch.no_grad():
            logits = model(sequence).logits[0, -1].float()
        token = int(logits.argmax())
        logprobs.append(float(logits.log_softmax(-1)[token]))
        sequence = torch.cat([sequence, torch.tensor([[token]])], dim=1)
    return sequence[0, len(prompt) :].tolist(), logprobs


@pytest.mark.parametrize("case", ["llama", "mistral-window-sharded", "qwen2-qkv-bias"])
def test_greedy_tokens_and_logprobs_equal_transformers(tmp_path, case):
    hf = _save_transformers_model(tmp_path, case)
    llm = LLM(tmp_path, device="cpu", dtype="fp32", block_size=4)
    prompts = [[5, 17, 3], list(range(20, 31)), [7]]
    params = SamplingParams(max_tokens=8, logprobs=True, ignore_eos=True)
    outputs = llm.generate(prompts, params, progress=False)
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = hf_greedy(hf, prompt, 8)
        assert out.token_ids == tokens and out.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs))


def test_text_prompts_stop_strings_and_eos(tmp_path):
    _save_transformers_model(tmp_path, "llama")
    _write_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    llm = LLM(tmp_path, device="cpu", dtype="fp32")
    free = llm.generate("w4 w5", SamplingParams(max_tokens=12, ignore_eos=True))[0]
    words = free.text.split()
    assert free.prompt == "w4 w5" and len(free.token_ids) == 12 and words
    stop = words[min(2, len(words) - 1)]
    cut = llm.generate("w4 w5", SamplingParams(max_tokens=12, stop=[stop]))[0]
    assert stop not in cut.text and free.text.startswith(cut.text)
    assert cut.finish_reason == "stop"
    # the checkpoint's end tokens stop a request that does not ignore them
    eos = llm.generate("w4", SamplingParams(max_tokens=40))[0]
    assert 1 not in eos.token_ids and 2 not in eos.token_ids


def test_bad_requests_fail_before_anything_runs(tmp_path):
    _save_transformers_model(tmp_path, "llama")
    llm = LLM(tmp_path, device="cpu", dtype="fp32", max_seq_len=64)
    with pytest.raises(ValueError, match="60 tokens \\+ max_tokens 16 = 76 tokens exceeds"):
        llm.generate([[1, 2], list(range(60))], SamplingParams())
    assert not llm.engine.waiting and not llm.engine.running  # the good prompt did not start
    with pytest.raises(ValueError, match="prompt token 97 is not a token id"):
        llm.generate([[1, 97]])
    with pytest.raises(ValueError, match="top_q"):
        SamplingParams(top_q=0.9)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text without a tokenizer")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]))
    with pytest.raises(FileNotFoundError, match="no checkpoint found"):
        LLM(tmp_path / "absent", device="cpu")
    # (refused before the checkpoint is read: the absent one would say so otherwise)
    with pytest.raises(ValueError, match="max_seq_len must be a positive integer, got -5"):
        LLM(tmp_path / "absent", device="cpu", max_seq_len=-5)
    with pytest.raises(ValueError, match="max_running must be a positive integer, got 0"):
        LLM(tmp_path / "absent", device="cpu", max_running=0)


def test_warm_up_leaves_a_clean_engine(tmp_path):
    # what LLM runs on CUDA before the first request (greedy and sampled steps of every size
    # class), run here on the CPU: afterwards the engine holds nothing and counts from zero
    _save_transformers_model(tmp_path, "llama")
    llm = LLM(tmp_path, device="cpu", dtype="fp32")
    llm._warm_up()
    engine = llm.engine
    assert not engine.requests and not engine.running and not engine.waiting
    assert engine.steps == engine.decode_steps == 0 and not llm.cache.tables
    assert llm.cache.pool.num_free == llm.cache.pool.num_blocks
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.request_id == 0 and len(out.token_ids) == 3


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_weights_load_block_by_block_and_generate(tmp_path, kind):
    """LLM(quantize=...) holds every block's linear layers quantized and the head in int8 (the
    embedding as it was; quantize_head=False keeps the head too) and generates the greedy tokens
    of the same model with those weights dequantized."""
    from memfit.nn.quant import QuantLinear, dequantize_model

    _save_transformers_model(tmp_path, "llama")
    llm = LLM(tmp_path, device="cpu", dtype="fp32", quantize=kind)
    layers = [m for m in llm.model.layers.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 4 * len(llm.model.layers)  # qkv, out, gate_up, down
    assert all(layer.quant.kind == kind for layer in layers)
    assert isinstance(llm.model.lm_head, QuantLinear) and llm.model.lm_head.quant.kind == "int8"
    kept = LLM(tmp_path, device="cpu", dtype="fp32", quantize=kind, quantize_head=False)
    assert not isinstance(kept.model.lm_head, QuantLinear)
    prompts = [[5, 17, 3], list(range(20, 31))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    quantized = [out.token_ids for out in llm.generate(prompts, params, progress=False)]
    reference = LLM(tmp_path, device="cpu", dtype="fp32")
    reference.model = dequantize_model(llm.model)
    reference.engine.model = reference.model
    assert [o.token_ids for o in reference.generate(prompts, params, progress=False)] == quantized
    with pytest.raises(ValueError, match="'int8' or 'int4'"):
        LLM(tmp_path, device="cpu", quantize="int3")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_quantized_checkpoint_round_trips(tmp_path, capsys, kind):
    """`memfit export --quantize` writes the quantized weights with their scales (and the
    tokenizer); LLM loads them as stored and generates the tokens of quantizing at load;
    asking the checkpoint for another kind says which it holds."""
    from safetensors import safe_open

    from memfit.cli.main import main
    from memfit.nn.quant import QuantLinear

    source, out = tmp_path / "hf", tmp_path / "quantized"
    _save_transformers_model(source, "llama")
    _write_tokenizer(source)
    assert (
        main(["export", str(source), "--quantize", kind, "--dtype", "fp32", "--out", str(out)]) == 0
    )
    assert (out / "tokenizer.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["kind"] == kind
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
    stored = "quant.q" if kind == "int8" else "quant.packed"
    assert f"layers.0.mlp.down.{stored}" in names and "layers.0.mlp.down.quant.scale" in names

    loaded = LLM(out, device="cpu", dtype="fp32")
    assert loaded.quantize == kind
    assert all(
        layer.quant.kind == kind
        for layer in loaded.model.layers.modules()
        if isinstance(layer, QuantLinear)
    )
    assert loaded.model.lm_head.quant.kind == "int8"  # the head, quantized at load
    at_load = LLM(source, device="cpu", dtype="fp32", quantize=kind)
    prompts = ["w5 w6 w7", [5, 17, 3, 9]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert [o.token_ids for o in loaded.generate(prompts, params, progress=False)] == [
        o.token_ids for o in at_load.generate(prompts, params, progress=False)
    ]
    other = "int4" if kind == "int8" else "int8"
    with pytest.raises(ValueError, match=f"holds {kind}-quantized weights"):
        LLM(out, device="cpu", quantize=other)
    assert main(["export", str(source), "--quantize", kind, "--out", str(out)]) != 0
    assert main(["export", str(out), "--quantize", kind, "--out", str(tmp_path / "x")]) != 0
    assert f"already holds {kind}-quantized weights" in capsys.readouterr().err
    # a config that does not describe the tensors: what is missing, before anything is read
    config["quantization_config"]["kind"] = other
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"does not hold this {other} model's tensors; missing"):
        LLM(out, device="cpu")


@pytest.mark.parametrize(
    ("method", "device"),
    [
        ("gptq", "cpu"),
        ("awq+gptq", "cpu"),
        pytest.param("gptq", "cuda", marks=pytest.mark.skipif(
            not torch.cuda.is_available(), reason="needs a CUDA GPU")),
    ],
)  # fmt: skip
def test_a_calibrated_export_records_its_method_and_loads(tmp_path, capsys, method, device):
    """`memfit export --quantize int4 --calibrate ...`: the levels chosen on the calibration
    text (GPTQ keeps round to nearest's grids and moves weights between levels), recorded in
    the config; the checkpoint loads as stored and generates. --calibrate alone is refused."""
    from safetensors import safe_open

    from memfit.cli.main import main

    source, out, plain = tmp_path / "hf", tmp_path / "calibrated", tmp_path / "plain"
    _save_transformers_model(source, "llama")
    _write_tokenizer(source)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{(i * 7) % 60}" for i in range(1200)))
    common = ["--quantize", "int4", "--dtype", "fp32", "--device", device]
    assert main(["export", str(source), *common, "--out", str(plain)]) == 0
    assert main(["export", str(source), *common, "--calibrate", method, "--calibration-text",
                 str(text), "--calibration-tokens", "1024", "--out", str(out)]) == 0  # fmt: skip
    assert f"calibrating ({method}) on 1,024 tokens" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["calibration"] == method
    tensors = {}
    for directory in (plain, out):
        with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
            tensors[directory] = handle.get_tensor("layers.0.mlp.down.quant.packed")
    assert not torch.equal(tensors[plain], tensors[out])
    loaded = LLM(out, device="cpu", dtype="fp32")
    assert loaded.quantize == "int4"
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    assert len(loaded.generate([[5, 6, 7]], params, progress=False)[0].token_ids) == 4
    bad = ["export", str(source), "--calibrate", "gptq", "--out", str(tmp_path / "x")]
    assert main(bad) != 0
    assert "give --quantize too" in capsys.readouterr().err
