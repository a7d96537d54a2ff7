"""`memfit generate`: load a checkpoint, continue a prompt (the static-cache `generate`), or a
file of prompts through the paged engine with continuous batching; report speed and KV use."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import Progress

from memfit.inference.engine import Engine
from memfit.inference.generate import generate
from memfit.inference.paged_cache import PagedKVCache
from memfit.inference.sampling_params import SamplingParams
from memfit.train.checkpoint import load_for_inference
from memfit.train.data import load_tokenizer
from memfit.train.engine import resolve_device


def run_generate(args: argparse.Namespace, console: Console) -> int:
    device = resolve_device(args.device)
    model, meta = load_for_inference(args.checkpoint, device)
    if device.type == "cuda":
        model.to(torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    tokenizer = load_tokenizer(args.tokenizer or meta["tokenizer"])
    if args.prompts:
        return run_prompts(args, console, model, meta, tokenizer, device)
    ids = tokenizer.encode(args.prompt)
    if tokenizer.bos_id is not None and not ids:
        ids = [tokenizer.bos_id]
    if not ids:
        ids = [tokenizer.eos_id]  # an empty prompt starts a fresh document
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    result = generate(
        model,
        prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        eos_id=tokenizer.eos_id,
        seed=args.seed,
    )
    console.print(f"[bold]{args.prompt}[/]" + tokenizer.decode(result.tokens[0]), highlight=False)
    console.print(
        f"[dim]step {meta['step']} checkpoint; {len(result.tokens[0])} tokens; prefill {result.prefill_s * 1e3:.1f} ms; "
        f"decode {result.decode_tokens_per_s:,.1f} tok/s[/]",
        highlight=False,
    )
    return 0


def read_prompts(path: str) -> list[str]:
    """One prompt per line, or JSONL objects with a "prompt" (or "text") field."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--prompts file {path!r} does not exist")
    prompts = []
    for number, line in enumerate(file.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not valid JSON: {error}") from None
            if "prompt" not in record and "text" not in record:
                raise ValueError(f'{path}:{number}: a JSON line needs a "prompt" field')
            prompts.append(str(record.get("prompt", record.get("text"))))
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"--prompts file {path!r} holds no prompt")
    return prompts


def run_prompts(args, console: Console, model, meta, tokenizer, device) -> int:
    texts = read_prompts(args.prompts)
    encoded = [tokenizer.encode(t) or [tokenizer.eos_id] for t in texts]
    dtype = next(model.parameters()).dtype
    config = model.config
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        budget = int(total * args.kv_memory_fraction) - torch.cuda.memory_allocated(device)
        cache = PagedKVCache.from_budget(
            config, budget, block_size=args.block_size, dtype=dtype, device=device
        )
    else:  # room for every request at its longest: the CPU has no pool to fill
        tokens = sum(len(ids) + args.max_new_tokens for ids in encoded)
        blocks = len(encoded) + tokens // args.block_size
        cache = PagedKVCache(
            config, num_blocks=blocks, block_size=args.block_size, dtype=dtype, device=device
        )
    engine = Engine(model, cache)
    for number, ids in enumerate(encoded):
        engine.add(
            ids,
            SamplingParams(
                max_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed + number,
                stop_token_ids=(tokenizer.eos_id,) if tokenizer.eos_id is not None else (),
            ),
        )
    start = time.perf_counter()
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("generating", total=len(encoded))
        while engine.waiting or engine.running:
            engine.step()
            progress.update(task, completed=sum(r.finished for r in engine.requests))
    elapsed = time.perf_counter() - start
    outputs = [r.output for r in engine.requests]
    lines = [
        json.dumps({"prompt": text, "completion": tokenizer.decode(out)})
        for text, out in zip(texts, outputs, strict=True)
    ]
    if args.output:
        Path(args.output).write_text("".join(line + "\n" for line in lines))
    else:
        for line in lines:
            console.print(line, highlight=False, markup=False)
    generated = sum(len(out) for out in outputs)
    console.print(
        f"[dim]{len(outputs)} requests, {generated} new tokens in {elapsed:.2f} s "
        f"({generated / elapsed:,.1f} tok/s), {engine.steps} steps; KV blocks peak "
        f"{engine.peak_blocks} of {cache.pool.num_blocks} ({cache.block_size} tokens each); "
        f"{engine.preemptions} preemptions[/]",
        highlight=False,
    )
    return 0
