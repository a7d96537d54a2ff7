"""The engine alone (no HTTP) under the serving benchmark's load: requests of 64-512 prompt
tokens and 128 new tokens arriving as a Poisson process, stepped in this process as `memfit
serve`'s engine process steps them. Per step budget (`max_step_tokens`) and rate: output
tokens/s, inter-token latency (ITL) and time to first token as the engine hands tokens out, and
per step that mixes prefill chunks with decodes: its wall time, the host's scheduling time, and
the GPU time of its graph replay (CUDA events). What the HTTP side adds is benchmarks/serve.py's.

    python benchmarks/engine_load.py --budgets 2048 512 --rates 256 inf --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

from memfit.inference import LLM, SamplingParams  # noqa: E402


def prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(64, 512))] for _ in range(count)]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_load(llm: LLM, batch: list[list[int]], rate: float, new_tokens: int) -> dict:
    """Send `batch` at `rate` requests/s (inf: all at once; 0: one after another) and step the
    engine until all have finished."""
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    rng, start = random.Random(0), time.perf_counter() + 0.05
    arrivals, t = [], start
    for _ in batch:
        arrivals.append(t)
        t += rng.expovariate(rate) if 0 < rate < float("inf") else 0.0
    seen: dict[int, int] = {}
    times: dict[int, list[tuple[float, int]]] = {}
    added: dict[int, float] = {}
    steps: list[dict] = []
    sent = 0

    def on_step() -> bool:  # (what EngineCore does after every step: hand out the new tokens)
        now = time.perf_counter()
        for rid, request in engine.requests.items():
            have = len(request.output)
            if have > seen.get(rid, 0):
                times.setdefault(rid, []).append((now, have - seen.get(rid, 0)))
                seen[rid] = have
        return sent < len(batch) and arrivals[sent] <= now  # a pipelined run ends for arrivals

    schedule, graphs = engine._schedule, engine.step_graphs
    replay = graphs.run if graphs is not None else None

    def timed_schedule():
        begin = time.perf_counter()
        chosen = schedule()
        tokens = sum(len(new) for _, new in chosen)
        steps.append({"schedule": time.perf_counter() - begin, "tokens": tokens})
        return chosen

    def timed_replay(*args, **kwargs):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        events[0].record()
        logits = replay(*args, **kwargs)
        events[1].record()
        steps[-1]["events"] = events
        return logits

    engine.on_step, engine._schedule = on_step, timed_schedule
    if graphs is not None:
        graphs.run = timed_replay
    try:
        while sent < len(batch) or engine.waiting or engine.running:
            now = time.perf_counter()
            if rate == 0:
                if not (engine.waiting or engine.running):
                    added[engine.add(batch[sent], params)] = time.perf_counter()
                    sent += 1
            else:
                while sent < len(batch) and arrivals[sent] <= now:
                    added[engine.add(batch[sent], params)] = arrivals[sent]
                    sent += 1
            if not (engine.waiting or engine.running):
                time.sleep(max(0.0, arrivals[sent] - time.perf_counter()))
                continue
            begin = time.perf_counter()
            engine.step()
            if steps and "wall" not in steps[-1]:  # (a step that scheduled: not pipelined)
                steps[-1]["wall"] = time.perf_counter() - begin
        end = time.perf_counter()
    finally:
        engine.on_step, engine._schedule = None, schedule
        if graphs is not None:
            graphs.run = replay
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    for step in steps:
        if "events" in step:
            first, last = step.pop("events")
            step["gpu"] = first.elapsed_time(last) / 1e3
    itl, ttft, tokens = [], [], 0
    for rid, got in times.items():
        ttft.append(got[0][0] - added[rid])
        previous = got[0][0]
        for at, count in got[1:]:
            itl += [(at - previous) / count] * count
            previous = at
        tokens += sum(count for _, count in got)
    for rid in list(engine.requests):
        engine.forget(rid)
    began = start if rate else min(added.values())
    mixed = [s for s in steps if "wall" in s]
    ms = lambda values, q: 1e3 * _pct(values, q)  # noqa: E731
    return {
        "rate": {0: "one at a time", float("inf"): "inf"}.get(rate, rate),
        "tokens_per_s": tokens / (end - began), "seconds": end - began,
        "itl_ms": {q: ms(itl, p) for q, p in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
        "ttft_ms": {"p50": ms(ttft, 0.5), "p99": ms(ttft, 0.99)},
        "scheduled_steps": len(mixed),
        "step_tokens_mean": sum(s["tokens"] for s in mixed) / max(len(mixed), 1),
        "step_wall_ms": {"p50": ms([s["wall"] for s in mixed], 0.5),
                         "p99": ms([s["wall"] for s in mixed], 0.99)},
        "step_graph_gpu_ms": {"p50": ms([s["gpu"] for s in mixed if "gpu" in s], 0.5),
                              "p99": ms([s["gpu"] for s in mixed if "gpu" in s], 0.99)},
        "schedule_ms": {"p50": ms([s["schedule"] for s in mixed], 0.5),
                        "p99": ms([s["schedule"] for s in mixed], 0.99)},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.2-1b")
    parser.add_argument("--budgets", nargs="+", type=int, default=[2048, 512])
    parser.add_argument("--rates", nargs="+", type=float, default=[256, float("inf")])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    rows = []
    for budget in args.budgets:
        llm = LLM(
            args.model, max_seq_len=4096, prefix_caching=True, max_step_tokens=budget,
            max_running=args.max_running,
        )  # fmt: skip
        vocab = llm.config.vocab_size
        run_load(llm, prompts(16, vocab, seed=9), float("inf"), 8)  # (warm-up)
        for rate in [0.0, *args.rates]:
            count = 8 if rate == 0 else args.requests
            batch = prompts(count, vocab, seed=100 + len(rows))
            row = run_load(llm, batch, rate, args.new_tokens)
            row |= {"max_step_tokens": budget, "max_running": args.max_running}
            print(json.dumps(row), flush=True)
            rows.append(row)
        del llm
        gc.collect()  # (the engine's graphs and pool, before the next budget's)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    run = {"env": harness.environment(), "model": args.model, "requests": args.requests,
           "new_tokens": args.new_tokens, "rows": rows}  # fmt: skip
    if args.out is not None:
        harness.RESULTS = args.out
    print(f"results: {harness.append_results('engine_load', run)}")


if __name__ == "__main__":
    main()
