import pytest
import torch

from memfit.inference.generate import generate, sample
from memfit.inference.kv_cache import KVCache
from memfit.models import PRESETS, build_model


@pytest.mark.parametrize("window", [None, 6])
def test_cached_decoding_matches_full_recompute(window):
    """Greedy decoding through the static cache (GQA: tiny has 4 query heads, 2 key/value heads;
    a sliding window shorter than the sequence) equals rerunning the whole sequence per token."""
    config = PRESETS["tiny"].replace(sliding_window=window)
    model = build_model(config, seed=0).eval()
    prompt = torch.randint(0, config.vocab_size, (3, 11))
    result = generate(model, prompt, max_new_tokens=9, temperature=0.0)
    # greedy reference without a cache: rerun the whole sequence for every new token
    sequence = prompt
    for _ in range(9):
        with torch.no_grad():
            next_token = model(sequence)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    assert result.tokens == sequence[:, 11:].tolist()


def test_kv_cache_logits_match_uncached_forward():
    config = PRESETS["tiny"].replace(sliding_window=6)
    model = build_model(config, seed=1).eval()
    tokens = torch.randint(0, config.vocab_size, (2, 15))
    cache = KVCache(config, batch_size=2, max_seq_len=15, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        full = model(tokens)
        first = model(tokens[:, :9], kv_cache=cache, start_pos=0)
        rest = model(tokens[:, 9:], kv_cache=cache, start_pos=9)  # a chunked prefill
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, rtol=1e-5, atol=1e-5)


def test_decode_does_not_sync_the_host_every_step(monkeypatch):
    """New tokens stay on the device: one read at the end, and an all-rows-stopped check every
    EOS_CHECK_EVERY steps; decode steps have the same shapes (a static cache and mask)."""
    import importlib

    generate_module = importlib.import_module("memfit.inference.generate")

    config = PRESETS["tiny"]
    model = build_model(config, seed=0).eval()
    prompt = torch.randint(0, config.vocab_size, (2, 5))
    calls = {"tolist": 0, "item": 0, "bool": 0}
    for name, attribute in (("tolist", "tolist"), ("item", "item"), ("bool", "__bool__")):
        original = getattr(torch.Tensor, attribute)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, attribute, counted)
    shapes = set()
    forward = model.forward
    monkeypatch.setattr(
        model,
        "forward",
        lambda tokens, *a, **k: (
            shapes.add((tuple(tokens.shape), k["kv_cache"] is not None)) or forward(tokens, *a, **k)
        ),
    )
    steps = 40
    result = generate(
        model, prompt, max_new_tokens=steps, temperature=0.0, eos_id=config.vocab_size
    )
    assert all(len(row) == steps for row in result.tokens)
    assert calls["tolist"] == 1 and calls["item"] == 0
    assert calls["bool"] <= (steps - 1) // generate_module.EOS_CHECK_EVERY
    assert shapes == {((2, 5), True), ((2, 1), True)}  # the prefill, then one decode shape


def test_eos_stops_a_row():
    config = PRESETS["tiny"]
    model = build_model(config, seed=0).eval()
    prompt = torch.randint(0, config.vocab_size, (1, 5))
    greedy = generate(model, prompt, max_new_tokens=6, temperature=0.0).tokens[0]
    stopped = generate(model, prompt, max_new_tokens=6, temperature=0.0, eos_id=greedy[2]).tokens[0]
    assert stopped == greedy[: greedy.index(greedy[2])]


def test_sampling_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).log_softmax(-1)
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, temperature=1.0, top_k=2, generator=gen)) for _ in range(200)}
    assert draws == {2, 3}
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    draws = {
        int(sample(probs.log(), temperature=1.0, top_p=0.7, generator=gen)) for _ in range(200)
    }
    assert draws == {0, 1}
    assert int(sample(logits, temperature=0.0)) == 3
    with pytest.raises(ValueError, match="top_p"):
        sample(logits, temperature=1.0, top_p=0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cached_decoding_on_cuda_bf16():
    config = PRESETS["tiny"]
    model = build_model(config, device="cuda", seed=0).to(torch.bfloat16).eval()
    prompt = torch.randint(0, config.vocab_size, (2, 13), device="cuda")
    cache = KVCache(config, batch_size=2, max_seq_len=20, dtype=torch.bfloat16, device="cuda")
    tokens = torch.cat([prompt, torch.randint(0, config.vocab_size, (2, 7), device="cuda")], dim=1)
    with torch.no_grad():
        full = model(tokens).float()
        parts = [model(tokens[:, :13], kv_cache=cache, start_pos=0)]
        parts += [model(tokens[:, i : i + 1], kv_cache=cache, start_pos=i) for i in range(13, 20)]
    torch.testing.assert_close(torch.cat(parts, dim=1).float(), full, rtol=2e-2, atol=2e-2)
    result = generate(model, prompt, max_new_tokens=8, temperature=0.0)
    assert all(len(row) == 8 for row in result.tokens)
