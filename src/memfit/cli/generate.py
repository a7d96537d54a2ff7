"""`memfit generate MODEL`: continue one prompt, or every prompt of a file, through the paged
engine with continuous batching (memfit.inference.LLM); report speed and KV use. MODEL is a
memfit run or checkpoint directory, a Hugging Face checkpoint directory, or a preset name (random
weights: prompts must then be token ids, so only for smoke tests)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.text import Text

from memfit.config import check_at_least, check_between, check_device_spec
from memfit.inference.llm import LLM
from memfit.inference.sampling_params import SamplingParams
from memfit.train.engine import resolve_device

# SamplingParams' fields by the flags that set them, to name the flag in its errors
_SAMPLING_FLAGS = {
    "max_tokens": "--max-new-tokens",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repetition-penalty",
    "seed": "--seed",
}


def check_engine_flags(args: argparse.Namespace) -> None:
    """The flags `generate` and `serve` share, refused before a model is loaded."""
    check_device_spec(args.device, "--device")
    check_at_least("--block-size", args.block_size, 1)
    check_between("--gpu-memory-fraction", args.gpu_memory_fraction, 0, 1, low_open=True)
    if args.max_model_len is not None:
        check_at_least("--max-model-len", args.max_model_len, 1)


def sampling_params(args: argparse.Namespace, seed: int) -> SamplingParams:
    """generate's sampling flags as SamplingParams, whose checks are the ones a server request
    gets; an error names the flag."""
    try:
        return SamplingParams(
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            seed=seed,
        )
    except ValueError as error:  # "temperature must be finite, got nan" -> "--temperature ..."
        field, _, rest = str(error).partition(" ")
        if field in _SAMPLING_FLAGS:
            raise ValueError(f"{_SAMPLING_FLAGS[field]} {rest}") from None
        raise


def run_generate(args: argparse.Namespace, console: Console) -> int:
    # every flag and file is checked before the model is loaded
    check_engine_flags(args)
    sampling_params(args, args.seed)
    texts = read_prompts(args.prompts) if args.prompts else [args.prompt]
    if args.output is not None:
        output = Path(args.output)
        if output.is_dir():
            raise IsADirectoryError(f"--output {args.output!r} is a directory; give a file's path")
        if not output.parent.is_dir():
            raise FileNotFoundError(
                f"--output {args.output!r}: {str(output.parent)!r} is no directory"
            )
    tokenizer = None
    if args.tokenizer:
        from memfit.train.data import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    device = resolve_device(args.device)
    llm = LLM(
        args.model, device=device, memory_fraction=args.gpu_memory_fraction,
        block_size=args.block_size, max_seq_len=args.max_model_len, tokenizer=tokenizer,
        quantize=args.quantize, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    params = [sampling_params(args, args.seed + number) for number in range(len(texts))]
    outputs = llm.generate(texts, params, progress=bool(args.prompts))
    stats = llm.last_stats
    if not args.prompts:
        out = outputs[0]
        # the prompt and the completion are the user's and the model's text, never markup
        console.print(Text.assemble((args.prompt, "bold"), out.text or ""), highlight=False)
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
        raise FileNotFoundError(
            f"--prompts file {path!r} {'is a directory' if file.is_dir() else 'does not exist'}"
        )
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompts file {path!r} is not UTF-8 text: {error}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
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
