"""Serving benchmark: `memfit serve`'s HTTP API under load, from a load generator in the same
process (Poisson arrivals, streamed completions over localhost).

    python benchmarks/serve.py                         # llama-3.2-1b shapes, random bf16 weights
    python benchmarks/serve.py --model tiny --device cpu --rates 2 --requests 8   # a smoke run

Parts (--parts):
- rates: requests with prompts uniform in 64..512 tokens and 128 new tokens each, arriving as a
  Poisson process at each rate of --rates (requests/s, "inf": all at once); per rate: output
  tokens/s, time to first token (TTFT) and inter-token latency (ITL, between two streamed
  tokens) p50/p99.
- prefix: --requests requests behind one shared 1,024-token system prompt (and 64 tokens of
  their own), all at once, with prefix caching on and off: peak KV blocks, mean TTFT,
  throughput.
- n: one 1,024-token prompt with n=4 (128 new tokens) against four separate requests of it,
  prefix caching off for the latter: peak KV blocks.

The model has random weights and no tokenizer: prompts are token ids and every request runs to
its max_tokens (ignore_eos). Results go to benchmarks/results/serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path

import httpx
import torch
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from memfit.inference import LLM  # noqa: E402
from memfit.inference.server import AsyncEngine, build_app  # noqa: E402


class Server:
    """memfit's API on a free localhost port, uvicorn in a thread."""

    def __init__(self, llm: LLM) -> None:
        self.engine = AsyncEngine(llm, max_waiting=100_000)
        self.engine.start()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        app = build_app(self.engine, model_name="m")
        self.server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.engine.stop()


async def _one(client, prompt, max_tokens, n, delay, start) -> dict:
    """One streamed request sent at start + delay: its arrival, first-token and token times."""
    await asyncio.sleep(max(0.0, start + delay - time.perf_counter()))
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "n": n, "stream": True,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    sent, times = time.perf_counter(), []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                count = len(json.loads(line[6:])["choices"][0]["token_ids"])
                times += [time.perf_counter()] * count
    return {"sent": sent, "times": times}


async def _load(url, prompts, max_tokens, rate, n=1) -> dict:
    """Send every prompt (Poisson arrivals at `rate` per second; inf: all at once)."""
    rng = random.Random(0)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        done = await asyncio.gather(
            *(
                _one(client, p, max_tokens, n, d, start)
                for p, d in zip(prompts, delays, strict=True)
            )
        )
        seconds = time.perf_counter() - start
    ttft = [r["times"][0] - r["sent"] for r in done if r["times"]]
    itl = [b - a for r in done for a, b in zip(r["times"], r["times"][1:], strict=False)]
    tokens = sum(len(r["times"]) for r in done)
    return {
        "rate": rate if rate != float("inf") else "inf", "requests": len(prompts),
        "output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "ttft_mean_s": sum(ttft) / len(ttft), "ttft": harness.percentiles(ttft) | _p99(ttft),
        "itl": harness.percentiles(itl) | _p99(itl) if itl else {},
    }  # fmt: skip


def _p99(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def _prompts(count, low, high, vocab, seed=0, prefix=()) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        list(prefix) + [rng.randrange(vocab) for _ in range(rng.randint(low, high))]
        for _ in range(count)
    ]


def _peak_blocks(llm: LLM) -> int:
    return llm.engine.peak_blocks


def rates_part(llm, args) -> list[dict]:
    vocab = llm.config.vocab_size
    rows = []
    server = Server(llm)
    try:
        for rate in args.rates:
            prompts = _prompts(args.requests, args.prompt_low, args.prompt_high, vocab, seed=1)
            row = asyncio.run(_load(server.url, prompts, args.new_tokens, rate))
            rows.append(row)
            print(
                f"rate {row['rate']}: {row['tokens_per_s']:,.0f} tokens/s, TTFT p50 "
                f"{row['ttft']['p50'] * 1e3:.0f} ms p99 {row['ttft']['p99'] * 1e3:.0f} ms, ITL p50 "
                f"{row['itl'].get('p50', 0) * 1e3:.1f} ms p99 {row['itl'].get('p99', 0) * 1e3:.1f} ms",
                flush=True,
            )
    finally:
        server.close()
    return rows


def prefix_part(llm, args) -> list[dict]:
    vocab = llm.config.vocab_size
    system = _prompts(1, args.prefix_len, args.prefix_len, vocab, seed=2)[0]
    prompts = _prompts(args.requests, 64, 64, vocab, seed=3, prefix=system)
    rows = []
    for caching in (False, True):
        llm.cache.prefix_caching = caching
        llm.engine.peak_blocks = 0
        server = Server(llm)
        try:
            row = asyncio.run(_load(server.url, prompts, args.new_tokens, float("inf")))
        finally:
            server.close()
        row |= {"prefix_caching": caching, "peak_blocks": _peak_blocks(llm)}
        rows.append(row)
        print(
            f"shared {args.prefix_len}-token prefix, caching {'on' if caching else 'off'}: peak "
            f"{row['peak_blocks']} blocks, mean TTFT {row['ttft_mean_s'] * 1e3:.0f} ms, "
            f"{row['tokens_per_s']:,.0f} tokens/s",
            flush=True,
        )
    return rows


def n_part(llm, args) -> dict:
    vocab = llm.config.vocab_size
    prompt = _prompts(1, args.prefix_len, args.prefix_len, vocab, seed=4)[0]
    result = {}
    for label, caching, prompts, n in (
        ("n=4", True, [prompt], 4),
        ("4 requests", False, [prompt] * 4, 1),
    ):
        llm.cache.prefix_caching = caching
        llm.engine.peak_blocks = 0
        server = Server(llm)
        try:
            asyncio.run(_load(server.url, prompts, args.new_tokens, float("inf"), n=n))
        finally:
            server.close()
        result[label] = _peak_blocks(llm)
    result["ratio"] = result["n=4"] / result["4 requests"]
    print(
        f"n=4 of a {args.prefix_len}-token prompt: peak {result['n=4']} blocks against "
        f"{result['4 requests']} for four requests ({result['ratio']:.0%})",
        flush=True,
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--parts", nargs="+", default=["rates", "prefix", "n"])
    parser.add_argument("--rates", nargs="+", type=float, default=[4, 8, 16, 32, 64, float("inf")])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--prompt-low", type=int, default=64)
    parser.add_argument("--prompt-high", type=int, default=512)
    parser.add_argument("--prefix-len", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, prefix_caching=True)
    run = {
        "env": harness.environment(),
        "model": args.model,
        "kv_blocks": llm.cache.pool.num_blocks,
    }
    if "rates" in args.parts:
        run["rates"] = rates_part(llm, args)
    if "prefix" in args.parts:
        run["prefix"] = prefix_part(llm, args)
    if "n" in args.parts:
        run["n"] = n_part(llm, args)
    if args.device == "cpu":
        print("(a CPU smoke run: nothing saved)")
        return
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('serve', run)}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
