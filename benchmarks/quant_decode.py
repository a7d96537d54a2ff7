"""Weight-only quantized batch-1 decode on one GPU: bf16 against int8 and int4 weights, each
measured in the same process.

    python benchmarks/quant_decode.py                        # kernels and batch1
    python benchmarks/quant_decode.py --parts sweep          # the kernel's launch configurations
    python benchmarks/quant_decode.py --parts floor --models llama-3-8b   # reading W alone

- kernels: the matrix-vector product of one token with each linear layer of a block (qkv, out,
  gate_up, down) of llama-3.2-3b and llama-3-8b, replayed from a CUDA graph with the weights
  rotated through copies larger than the L2 cache (cold, as in a decode step): cuBLAS and
  memfit's bf16 GEMV on the bf16 weight, memfit's quantized GEMV on int8 and int4 (group 128)
  weights; time and the bandwidth achieved reading the weight's bytes (scales included).
- sweep: the quantized GEMV's launch configurations (memfit.ops.quant.gemv.CONFIG) on
  llama-3-8b's layers.
- floor: how fast a kernel that only reads an int4 weight's words (no products, no x) streams
  each layer's bytes, by program shape (rows a program, words a row a step, warps), cold copies
  replayed from a CUDA graph as in `kernels`; gate_up also with its rows taken as the SwiGLU
  GEMV takes them (gate and up rows in turn): the bound a GEMV's loads set before any arithmetic.
- batch1: `LLM(preset, quantize=...)` with random weights (a quantized model's output head in
  int8: memfit.nn.quant.quantize_head), one prompt of 128 tokens, 256 new tokens: decode
  tokens/s from the engine's clock and the captured decode step replayed alone, against the
  limit of reading the model's bytes and the KV cache once a token at the measured copy
  bandwidth.

Results: benchmarks/results/quant_decode.json (`--out DIR` elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from inference import copy_bandwidth  # noqa: E402

from memfit.models import PRESETS  # noqa: E402
from memfit.ops import gemv as gemv_module  # noqa: E402
from memfit.ops._triton import tl, triton  # noqa: E402
from memfit.ops.quant import gemv as quant_gemv_module  # noqa: E402
from memfit.ops.quant import quantize_int4, quantize_int8  # noqa: E402

COLD_BYTES = 512 * 2**20  # the copies rotated through: ten times the H100's L2


def layer_shapes(name: str) -> dict[str, tuple[int, int]]:
    """(N, K) of a block's linear layers."""
    c = PRESETS[name]
    qkv = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    return {
        "qkv": (qkv, c.hidden_size),
        "out": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }


def _nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _copies(make, nbytes: int) -> list:
    return [make(i) for i in range(max(2, -(-COLD_BYTES // nbytes)))]


def graph_us(fns: list) -> float:
    """Microseconds of one call, the calls (one per weight copy) replayed from a CUDA graph."""
    return harness.graph_seconds(lambda: [fn() for fn in fns], calls=1) / len(fns) * 1e6


def _weights(n: int, k: int, seed: int, device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) * 0.02


QUANTIZE = {"int8": quantize_int8, "int4": quantize_int4}


def quant_states(kind: str, n: int, k: int, device) -> list[dict]:
    """Copies of an (n, k) weight quantized to `kind`, together larger than COLD_BYTES."""
    first = QUANTIZE[kind](_weights(n, k, 0, device))
    count = max(2, -(-COLD_BYTES // _nbytes(first)))
    return [first] + [QUANTIZE[kind](_weights(n, k, i, device)) for i in range(1, count)]


def quant_calls(x: torch.Tensor, states: list[dict], kind: str, n: int, k: int) -> list:
    return [lambda s=s: quant_gemv_module.quant_gemv(x, s, kind, (n, k)) for s in states]


def kernel_case(n: int, k: int, device) -> dict:
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    row = {"n": n, "k": k}
    bf16 = _copies(lambda i: _weights(n, k, i, device), 2 * n * k)
    row["cublas_us"] = graph_us([lambda w=w: F.linear(x, w) for w in bf16])
    row["memfit_bf16_us"] = graph_us([lambda w=w: gemv_module.gemv(x, w) for w in bf16])
    row["bf16_bytes"] = 2 * n * k
    del bf16
    for kind in QUANTIZE:
        states = quant_states(kind, n, k, device)
        row[f"{kind}_us"] = graph_us(quant_calls(x, states, kind, n, k))
        row[f"{kind}_bytes"] = _nbytes(states[0])
        del states
    for name in ("cublas", "memfit_bf16", "int8", "int4"):
        nbytes = row["bf16_bytes"] if name in ("cublas", "memfit_bf16") else row[f"{name}_bytes"]
        row[f"{name}_tb_s"] = nbytes / row[f"{name}_us"] / 1e6
    torch.cuda.empty_cache()
    return row


def kernels(device, models: list[str]) -> list[dict]:
    rows = []
    for name in models:
        for layer, (n, k) in layer_shapes(name).items():
            row = {"model": name, "layer": layer, **kernel_case(n, k, device)}
            print(
                f"{name} {layer} ({n}x{k}): cuBLAS {row['cublas_us']:.1f} us, memfit bf16 "
                f"{row['memfit_bf16_us']:.1f}, int8 {row['int8_us']:.1f} "
                f"({row['int8_tb_s']:.2f} TB/s), int4 {row['int4_us']:.1f} "
                f"({row['int4_tb_s']:.2f} TB/s)",
                flush=True,
            )
            rows.append(row)
    return rows


def sweep(device) -> list[dict]:
    shapes = layer_shapes("llama-3-8b")
    rows = []
    original = dict(quant_gemv_module.CONFIG)
    # rows a program; tiles of 1024-4096 features (int4 on CUDA: packed halves, groups of 128),
    # int8 of 512-2048; whatever the tile's width leaves of a program's threads goes to the rows
    grids = {
        "int4": itertools.product((2, 4, 8), (1024, 2048, 4096), (1, 2, 4), (1,)),
        "int8": itertools.product((1, 2, 4), (512, 1024, 2048), (2, 4, 8), (1,)),
    }
    key = {"int4": "int4_half", "int8": "int8"}
    for kind in QUANTIZE:
        cases = {}
        for layer, (n, k) in shapes.items():
            x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
            cases[layer] = quant_calls(x, quant_states(kind, n, k, device), kind, n, k)
        for config in grids[kind]:
            quant_gemv_module.CONFIG[key[kind]] = config
            row = {"kind": key[kind], "config": list(config)}
            try:
                for layer, calls in cases.items():
                    row[layer] = graph_us(calls)
                row["total_us"] = sum(row[layer] for layer in shapes)
            except Exception as error:  # a configuration that does not compile
                row["error"] = str(error)[:200]
            print(row, flush=True)
            rows.append(row)
        del cases
        torch.cuda.empty_cache()
    quant_gemv_module.CONFIG.update(original)
    return rows


@triton.jit
def _read_kernel(
    w_ptr, y_ptr, half_rows, WORDS: tl.constexpr, R: tl.constexpr, TILE: tl.constexpr,
    PAIRED: tl.constexpr,
):  # fmt: skip
    """R rows of int32 words (WORDS a row) read TILE at a time and XORed: a GEMV's loads alone.
    PAIRED: row i and row i + half_rows in turn (gate and up, as the SwiGLU GEMV reads them)."""
    i = tl.arange(0, R)
    if PAIRED:
        rows = tl.program_id(0) * (R // 2) + i // 2 + (i % 2) * half_rows
    else:
        rows = tl.program_id(0) * R + i
    acc = tl.zeros((R, TILE), dtype=tl.int32)
    for start in range(0, WORDS, TILE):
        cols = start + tl.arange(0, TILE)
        w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * WORDS + cols[None, :]
        acc ^= tl.load(w_ptrs, eviction_policy="evict_first")
    tl.store(y_ptr + rows, tl.xor_sum(acc, 1))


def _random_words(n: int, words: int, device, copy: int) -> torch.Tensor:
    """An (n, words) int32 weight of random words (`copy`: which of the copies; any values do)."""
    return torch.randint(-(2**31), 2**31 - 1, (n, words), dtype=torch.int32, device=device)


def _read_call(w: torch.Tensor, y: torch.Tensor, meta: dict) -> None:
    _read_kernel[(w.shape[0] // meta["R"],)](w, y, w.shape[0] // 2, **meta)


def _read_us(copies: list, r: int, tile: int, warps: int, paired: bool) -> float:
    n, words = copies[0].shape
    y = torch.empty(n, dtype=torch.int32, device=copies[0].device)
    meta = {"WORDS": words, "R": r, "TILE": tile, "PAIRED": paired, "num_warps": warps}
    return graph_us([functools.partial(_read_call, w, y, meta) for w in copies])


def floor(device, models: list[str]) -> list[dict]:
    rows = []
    tile = 128  # words: 1024 features, a divisor of the K / 8 of the 3B and 8B presets
    for name in models:
        for layer, (n, k) in layer_shapes(name).items():
            words = k // 8
            if words % tile:  # (the kernel reads whole tiles)
                print(f"floor: {name} {layer} skipped: K / 8 = {words} is not a multiple of {tile}")
                continue
            copies = _copies(functools.partial(_random_words, n, words, device), 4 * n * words)
            for paired in (False, True) if layer == "gate_up" else (False,):
                for r, warps in itertools.product((1, 2, 4, 8), (1, 2, 4)):
                    if not 4 <= r * tile // (32 * warps) <= 64:
                        continue
                    us = _read_us(copies, r, tile, warps, paired)
                    row = {"model": name, "layer": layer, "n": n, "k": k, "paired": paired,
                           "config": [r, tile, warps], "us": us,
                           "tb_s": 4 * n * words / us / 1e6}  # fmt: skip
                    print(row, flush=True)
                    rows.append(row)
            del copies
            torch.cuda.empty_cache()
    return rows


def batch1(device, copy_bw: float, models: list[str], new_tokens: int) -> list[dict]:
    from memfit.inference import LLM, SamplingParams

    rows = []
    for name in models:
        config = PRESETS[name]
        for quantize in (None, "int8", "int4"):
            start = time.perf_counter()
            llm = LLM(name, device=device, quantize=quantize)
            load_s = time.perf_counter() - start
            prompt = [list(range(1, 129))]
            params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
            llm.generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True), progress=False)
            out = llm.generate(prompt, params, progress=False)
            per_token = llm.last_stats["decode_seconds"] / max(llm.last_stats["decode_steps"], 1)
            graph = llm.engine.graphs.graphs[1]
            graph_s = harness.median(harness.time_calls(graph.replay, warmup=3, repeat=50))
            model_bytes = sum(
                t.numel() * t.element_size()
                for t in itertools.chain(llm.model.parameters(), llm.model.buffers())
            )
            embed = llm.model.embed.weight
            read = model_bytes - (
                embed.numel() * embed.element_size() if llm.model.lm_head is not None else 0
            )
            kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
            limit_s = (read + kv_per_token * (128 + new_tokens / 2)) / copy_bw
            row = {
                "model": name, "weights": quantize or "bf16", "load_s": load_s,
                "tokens_per_s": 1 / per_token, "ms_per_token": per_token * 1e3,
                "graph_ms_per_token": graph_s * 1e3, "model_bytes": model_bytes,
                "bytes_read_per_token": read, "limit_ms_per_token": limit_s * 1e3,
                "of_limit": limit_s / per_token, "first_tokens": out[0].token_ids[:8],
                "head": "int8" if hasattr(llm.model.lm_head, "quant") else "bf16",
            }  # fmt: skip
            print(
                f"{name} {row['weights']}: {row['tokens_per_s']:.1f} tokens/s, "
                f"{row['ms_per_token']:.3f} ms/token (graph {row['graph_ms_per_token']:.3f}), "
                f"limit {row['limit_ms_per_token']:.3f} ms ({row['of_limit']:.1%}), model "
                f"{model_bytes / 2**30:.2f} GiB, load {load_s:.1f} s",
                flush=True,
            )
            rows.append(row)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        base = next(r for r in rows if r["model"] == name and r["weights"] == "bf16")
        for r in rows:
            if r["model"] == name:
                r["speedup_vs_bf16"] = r["tokens_per_s"] / base["tokens_per_s"]
        print(
            f"{name}: "
            + ", ".join(
                f"{r['weights']} {r['speedup_vs_bf16']:.2f}x" for r in rows if r["model"] == name
            ),
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", nargs="+", default=["kernels", "batch1"])
    parser.add_argument("--models", nargs="+", default=["llama-3.2-3b", "llama-3-8b"])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/quant_decode.py needs a CUDA GPU")
    device = torch.device("cuda")
    run = {"env": harness.environment()}
    copy_bw = copy_bandwidth(device)
    run["copy_tb_s"] = copy_bw / 1e12
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s", flush=True)
    run["config"] = {k: list(v) for k, v in quant_gemv_module.CONFIG.items()}
    if "sweep" in args.parts:
        run["sweep"] = sweep(device)
    if "kernels" in args.parts:
        run["kernels"] = kernels(device, args.models)
    if "floor" in args.parts:
        run["floor"] = floor(device, args.models)
    if "batch1" in args.parts:
        run["batch1"] = batch1(device, copy_bw, args.models, args.new_tokens)
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('quant_decode', run)}")


if __name__ == "__main__":
    main()
