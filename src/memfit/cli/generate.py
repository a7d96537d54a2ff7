"""`memfit generate`: load a checkpoint, continue a prompt, report speed."""

from __future__ import annotations

import argparse

import torch
from rich.console import Console

from memfit.inference.generate import generate
from memfit.train.checkpoint import load_for_inference
from memfit.train.data import load_tokenizer
from memfit.train.engine import resolve_device


def run_generate(args: argparse.Namespace, console: Console) -> int:
    device = resolve_device(args.device)
    model, meta = load_for_inference(args.checkpoint, device)
    if device.type == "cuda":
        model.to(torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    tokenizer = load_tokenizer(args.tokenizer or meta["tokenizer"])
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
