"""Training with LoRA (`[lora]`, `--lora-rank`): only the adapters change, the frozen base sits
in the compute dtype without gradients or optimizer state, the loss falls, a resumed run is
exact, the adapters are written in peft's format, and the run's checkpoint loads (merged) for
inference. A Hugging Face checkpoint directory as the model starts from its weights."""

import pytest
import torch

from memfit.config import build_config
from memfit.models import build_model, load_pretrained
from memfit.models.config import PRESETS
from memfit.nn.lora import load_peft_adapter, lora_layers, read_peft_config
from memfit.train.engine import Trainer

LORA = {"rank": 4, "alpha": 8.0, "targets": "q_proj,v_proj,o_proj,down_proj"}


def make(tmp_path, name="run", *, steps=12, resume=False, model="tiny", lora=None, **train):
    flags = {
        "model": {"name": str(model)},
        "data": {"seq_len": 64},
        "train": {"steps": steps, "micro_batch": 4, "warmup_steps": 2, "device": "cpu",
                  "precision": "fp32", "lr": 1e-2, **train},
        "checkpoint": {"out": str(tmp_path / name), "resume": resume},
        "lora": lora or LORA,
    }  # fmt: skip
    return Trainer(build_config(flags=flags))


def test_only_adapters_train_and_the_loss_falls(tmp_path):
    trainer = make(tmp_path)
    base = build_model(PRESETS["tiny"], device="cpu", seed=0).state_dict()
    layers = lora_layers(trainer.model)
    assert len(layers) == 3 * PRESETS["tiny"].num_layers  # qkv (q and v), out, down
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert trainer._lora_trainable() == trainable  # (the checkpoint size estimate's count)
    optimized = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert optimized == {id(p) for n, p in trainer.model.named_parameters() if ".lora_" in n}
    history = trainer.fit()
    assert history[-1].loss < history[0].loss - 0.1
    for name, tensor in trainer.model.state_dict().items():
        if ".lora_" in name:
            continue
        assert torch.equal(tensor, base[name]), name  # the base never moves
    assert any(torch.count_nonzero(layer.lora_B["q_proj"]) for layer in layers.values()
               if "q_proj" in layer.lora_B)  # fmt: skip
    # the peft adapter beside the checkpoints: the same update on a fresh base
    spec = read_peft_config(tmp_path / "run" / "adapter")
    assert spec.rank == 4 and spec.names == ("q_proj", "v_proj", "o_proj", "down_proj")
    fresh = build_model(PRESETS["tiny"], device="cpu", seed=0).eval()
    load_peft_adapter(fresh, tmp_path / "run" / "adapter")
    trainer.model.eval()
    tokens = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        adapted = trainer.model(tokens)
        torch.testing.assert_close(fresh(tokens), adapted, rtol=0, atol=0)
        # the run's checkpoint loads merged, for `memfit generate`
        merged, info = load_pretrained(tmp_path / "run", device="cpu", dtype=torch.float32)
        assert not lora_layers(merged) and info.format == "memfit"
        torch.testing.assert_close(merged(tokens), adapted, rtol=1e-5, atol=1e-5)


def test_a_resumed_lora_run_is_exact(tmp_path):
    straight = make(tmp_path, "straight", steps=6)
    expected = [straight.train_step().loss for _ in range(6)]
    first = make(tmp_path, "resumed", steps=6)
    for _ in range(3):
        first.train_step()
    first.save()
    del first
    second = make(tmp_path, "resumed", steps=6, resume=True)
    assert [m.loss for m in second.fit()] == expected[3:]
    reference = dict(straight.model.named_parameters())
    for name, param in second.model.named_parameters():
        torch.testing.assert_close(param, reference[name], rtol=0, atol=0)


def test_bf16_keeps_the_frozen_base_in_bf16_and_the_adapters_in_fp32(tmp_path):
    trainer = make(tmp_path, steps=2, precision="bf16")
    for name, param in trainer.model.named_parameters():
        assert param.dtype == (torch.float32 if ".lora_" in name else torch.bfloat16), name
        assert param.requires_grad == (".lora_" in name)
    trainer.fit()


def test_training_from_a_hugging_face_checkpoint_starts_from_its_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=300, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, intermediate_size=80, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    hf.save_pretrained(tmp_path / "base")
    with pytest.raises(ValueError, match="has no tokenizer.json: pass the tokenizer"):
        make(tmp_path, "refused", steps=3, model=tmp_path / "base")
    _word_tokenizer(tmp_path / "base", 300)
    trainer = make(tmp_path, steps=3, model=tmp_path / "base")
    assert trainer.pretrained == (tmp_path / "base").resolve()
    assert trainer.config.data.tokenizer == str(trainer.pretrained)  # the model's own
    tokens = torch.randint(0, 300, (2, 13))
    trainer.model.eval()
    with torch.no_grad():  # B is zero: the model is the checkpoint's
        torch.testing.assert_close(
            trainer.model(tokens), hf.eval()(tokens).logits, rtol=1e-4, atol=2e-5
        )
    trainer.model.train()
    trainer.fit()
    assert read_peft_config(tmp_path / "run" / "adapter").rank == 4
    # `memfit export`: a Hugging Face checkpoint of the adapted model, adapters merged
    from memfit.cli.main import main

    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype",
                 "fp32"]) == 0  # fmt: skip
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert exported.config.model_type == "llama" and exported.config.vocab_size == 300
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        tmp_path / "base" / "tokenizer.json"
    ).read_bytes()
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            exported(tokens).logits, trainer.model(tokens), rtol=1e-4, atol=2e-5
        )
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2  # not empty


def test_export_of_a_preset_run_writes_its_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    trainer = make(tmp_path, steps=2, lora={"rank": 2})
    trainer.fit()
    from memfit.cli.main import main

    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "hf"), "--dtype",
                 "fp32"]) == 0  # fmt: skip
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, 256, (1, 9))
    trainer.model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            exported(tokens).logits, trainer.model(tokens), rtol=1e-4, atol=2e-5
        )


@pytest.mark.parametrize(
    "sections, message",
    [
        ({"lora": {"rank": 4, "targets": "qkv"}}, "unknown LoRA target 'qkv'"),
        ({"lora": {"rank": -1}}, "lora.rank must be >= 0"),
        ({"lora": {"rank": 4}, "distributed": {"zero": 3}}, "LoRA trains with --zero 0, 1 or 2"),
        (
            {"lora": {"rank": 4}, "distributed": {"offload": "optimizer"}},
            "without --zero 3 and --offload",
        ),
    ],
)
def test_bad_lora_settings_are_refused(sections, message):
    with pytest.raises(ValueError, match=message):
        build_config(flags=sections)


def _word_tokenizer(directory, vocab):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 1)} | {"</s>": vocab - 1}  # (packing needs EOS)
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def test_a_checkpoint_directory_with_pickled_weights_only_is_refused(tmp_path):
    directory = tmp_path / "pickled"
    directory.mkdir()
    (directory / "config.json").write_text(
        '{"model_type": "llama", "vocab_size": 300, "hidden_size": 48, "num_hidden_layers": 2,'
        ' "num_attention_heads": 6, "intermediate_size": 80}'
    )
    (directory / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="pytorch_model.bin, which memfit does not read"):
        make(tmp_path, model=directory)


def test_qlora_from_a_hugging_face_checkpoint_quantizes_one_block_at_a_time(tmp_path, monkeypatch):
    """Each block is read and quantized before the next is read (the later blocks still on the
    meta device), and the quantized base is the checkpoint's weights quantized."""
    transformers = pytest.importorskip("transformers")
    import memfit.nn.quant as quant

    config = transformers.AutoConfig.for_model(
        "llama", vocab_size=300, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "base")
    _word_tokenizer(tmp_path / "base", 300)
    seen, quantize_model = [], quant.quantize_model

    def spy(model, kind, *, blocks, **kwargs):
        later = range(blocks[0] + 1, len(model.layers))
        seen.append((blocks, [all(p.is_meta for p in model.layers[i].parameters()) for i in later]))
        return quantize_model(model, kind, blocks=blocks, **kwargs)

    monkeypatch.setattr(quant, "quantize_model", spy)
    qlora = {"rank": 4, "alpha": 8.0, "quantize": "nf4"}
    trainer = make(tmp_path, steps=4, model=tmp_path / "base", lora=qlora)
    assert seen == [([0], [True, True]), ([1], [True]), ([2], [])]
    reference, _ = load_pretrained(tmp_path / "base", device="cpu", dtype=torch.float32)
    quantize_model(reference, "nf4", dtype=torch.float32)
    expected = dict(reference.named_buffers())
    got = {n: b for n, b in trainer.model.named_buffers() if ".quant." in n}
    assert got.keys() == {n for n in expected if ".quant." in n} and len(got) == 3 * 4 * 4
    assert all(torch.equal(got[n], expected[n]) for n in got)
    history = trainer.fit()
    assert all(torch.isfinite(torch.tensor(m.loss)) for m in history)
