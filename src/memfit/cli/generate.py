"""`memfit generate MODEL`: continue one prompt, or every prompt of a file, through the paged
engine with continuous batching (memfit.inference.LLM); report speed and KV use. MODEL is a
memfit run or checkpoint directory, a Hugging Face checkpoint directory, or a preset name (random
weights: prompts must then be token ids, so only for smoke tests)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console

from memfit.inference.llm import LLM
from memfit.inference.sampling_params import SamplingParams
from memfit.train.engine import resolve_device


def run_generate(args: argparse.Namespace, console: Console) -> int:
    device = resolve_device(args.device)
    llm = LLM(
        args.model, device=device, memory_fraction=args.gpu_memory_fraction,
        block_size=args.block_size, max_seq_len=args.max_model_len,
    )  # fmt: skip
    if args.tokenizer:
        from memfit.train.data import load_tokenizer

        llm.tokenizer = load_tokenizer(args.tokenizer)
    texts = read_prompts(args.prompts) if args.prompts else [args.prompt]
    params = [
        SamplingParams(
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed + number,
        )  # fmt: skip
        for number in range(len(texts))
    ]
    outputs = llm.generate(texts, params, progress=bool(args.prompts))
    stats = llm.last_stats
    if not args.prompts:
        out = outputs[0]
        console.print(f"[bold]{args.prompt}[/]" + (out.text or ""), highlight=False)
        console.print(
            f"[dim]{len(out.token_ids)} tokens ({out.finish_reason}); "
            f"{stats['tokens_per_s']:,.1f} tok/s[/]",
            highlight=False,
        )
        return 0
    lines = [
        json.dumps({"prompt": text, "completion": out.text, "finish_reason": out.finish_reason})
        for text, out in zip(texts, outputs, strict=True)
    ]
    if args.output:
        Path(args.output).write_text("".join(line + "\n" for line in lines))
    else:
        for line in lines:
            console.print(line, highlight=False, markup=False)
    console.print(
        f"[dim]{stats['requests']} requests, {stats['generated_tokens']} new tokens in "
        f"{stats['seconds']:.2f} s ({stats['tokens_per_s']:,.1f} tok/s), {stats['steps']} steps; "
        f"KV blocks peak {stats['kv_blocks_peak']} of {stats['kv_blocks']} "
        f"({llm.cache.block_size} tokens each), mean waste {stats['kv_waste_mean']:.1%}; "
        f"{stats['preemptions']} preemptions[/]",
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
