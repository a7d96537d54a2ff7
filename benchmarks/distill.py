"""The distillation loss (memfit.ops.distill) against the unfused loss a user writes in PyTorch,
forward + backward, the same GPU and process: time and the memory the loss adds.

Shapes: a llama-1b student (hidden 2048) and a llama-3-8b teacher (hidden 4096) over llama-3's
vocabulary of 128,256, N tokens (default 8192 and 16384), bf16 autocast, the student's head fp32
(a fully trained student) as the model keeps it; KL at temperature 2, alpha 0.5.

- "unfused": logits = hidden @ W^T for both models (bf16), F.cross_entropy on the student's and
  F.kl_div between the log-softmaxes in fp32, as a user writes it; autograd keeps what it needs.
- "memfit plain": memfit.ops.distill with its per-row work in PyTorch (KERNEL_ON_CUDA off).
- "memfit kernel": the same with the Triton row kernel (KERNEL_ON_CUDA on, the default).

    python benchmarks/distill.py --tokens 8192 16384

Time: median of CUDA-event times of forward + backward after warm-up. Extra memory: peak
allocated during the call minus what was allocated before it (inputs and weights).
"""

from __future__ import annotations

import argparse

import harness
import torch
import torch.nn.functional as F

from memfit.ops import distill


def unfused(hidden, weight, teacher_hidden, teacher_weight, targets, alpha, temperature):
    s = hidden @ weight.T
    with torch.no_grad():
        t = teacher_hidden @ teacher_weight.T
    ce = F.cross_entropy(s.float(), targets, reduction="sum")
    log_q = F.log_softmax(s.float() / temperature, -1)
    log_p = F.log_softmax(t.float() / temperature, -1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="sum")
    return (1 - alpha) * ce + alpha * temperature**2 * kl


def measure(system: str, tokens: int, args) -> dict:
    torch.manual_seed(0)
    vocab, d, d_t = args.vocab, args.student_hidden, args.teacher_hidden
    hidden = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(vocab, d, device="cuda") / d**0.5).requires_grad_()
    teacher_hidden = torch.randn(tokens, d_t, device="cuda", dtype=torch.bfloat16)
    teacher_weight = torch.randn(vocab, d_t, device="cuda", dtype=torch.bfloat16) / d_t**0.5
    targets = torch.randint(0, vocab, (tokens,), device="cuda")
    distill.KERNEL_ON_CUDA = system == "memfit kernel"

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if system == "unfused":
                loss = unfused(hidden, weight, teacher_hidden, teacher_weight, targets, 0.5, 2.0)
            else:
                loss = distill.linear_distillation_loss(
                    hidden, weight, teacher_hidden, teacher_weight, targets, alpha=0.5,
                    temperature=2.0,
                )  # fmt: skip
        loss.backward()
        hidden.grad = weight.grad = None
        return loss

    loss = step().item()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    seconds = harness.median(harness.time_calls(step, warmup=2, repeat=args.repeat))
    return {"tokens": tokens, "system": system, "ms": seconds * 1e3,
            "extra_gib": extra / 2**30, "loss": loss}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--student-hidden", type=int, default=2048)
    parser.add_argument("--teacher-hidden", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument(
        "--systems", nargs="+", default=["unfused", "memfit plain", "memfit kernel"]
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    run = {"env": harness.environment(), "vocab": args.vocab, "student_hidden":
           args.student_hidden, "teacher_hidden": args.teacher_hidden, "records": []}  # fmt: skip
    for tokens in args.tokens:
        for system in args.systems:
            try:
                row = measure(system, tokens, args)
            except torch.OutOfMemoryError as error:
                row = {"tokens": tokens, "system": system, "error": str(error)[:300]}
            torch.cuda.empty_cache()
            run["records"].append(row)
            print(row, flush=True)
    print(f"results: {harness.append_results('distill', run, args.out)}")


if __name__ == "__main__":
    main()
