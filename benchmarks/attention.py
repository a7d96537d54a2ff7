"""Attention kernels on one GPU: memfit's Triton FlashAttention against torch SDPA (its
FlashAttention-2 and cuDNN backends) and FlexAttention, same inputs, same process (the settings of
ANCHORS.md, "Attention").

Sections (`--sections`, all three by default):

  throughput  B*N = 16384 tokens, H*D = 2048, D in {64, 128}, N in {1k, 2k, 4k, 8k, 16k}, causal
              and not; forward and forward+backward TFLOP/s of memfit, sdpa-flash, sdpa-cudnn and
              (D = 128 only, it compiles per shape) flex. FLOPs: forward 4*B*H*N^2*D, halved when
              causal; forward+backward 3.5x forward. Each shape also checks memfit's output and
              gradients against sdpa-flash (max abs difference, recorded and printed).
  window      causal sliding window of 1024 tokens, B=1, H=16, D=128, N in {8k, 16k}: forward and
              forward+backward milliseconds of memfit (window=(1023, 0)), flex (sliding-window
              block mask), sdpa-mask (SDPA's memory-efficient kernel with an explicit boolean mask,
              dense work, only N <= --mask-max-seqlen) and memfit-dense (memfit, plain causal: what
              the window saves).
  memory      causal, B=1, H=16, D=128, N in {4k ... 128k}: peak bytes allocated by one
              forward+backward over what was allocated before it (q, k, v and grad_out), for
              memfit, sdpa-flash, sdpa-cudnn and sdpa-math (N <= --math-max-seqlen; OOM recorded).

Inputs are (B, N, H, D) tensors, as the model holds them; SDPA and Flex get (B, H, N, D) transposed
views, like a model calling them would. Times are CUDA-event times, median of --repeat calls after
--warmup calls (the first of which compiles / autotunes). An implementation that raises is recorded
with an "error" string and the run goes on.

    python benchmarks/attention.py                      # everything, about 4-5 minutes on an H100
    python benchmarks/attention.py --sections throughput --head-dims 128 --seqlens 8192 --causal yes
    python benchmarks/attention.py --out $OUT           # results and plot under $OUT (a GPU box)

Writes DIR/attention.json (a list of runs; this run appended), DIR/attention_tflops.png, and while
running DIR/attention.partial.json (the run so far, removed at the end), DIR = --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import harness
import torch
import torch.nn.functional as F
from harness import append_results, cuda_span, environment, percentiles, time_calls
from rich.console import Console
from rich.table import Table

IMPLS = ("memfit", "sdpa-flash", "sdpa-cudnn", "flex")
WINDOW_IMPLS = ("memfit", "flex", "sdpa-mask", "memfit-dense")
MEMORY_IMPLS = ("memfit", "sdpa-flash", "sdpa-cudnn", "sdpa-math", "flex")
SECTIONS = ("throughput", "window", "memory")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# memfit's output / gradients are flagged when their max abs difference to the reference exceeds
# this fraction of the reference's max abs value (bf16 rounding alone is about 0.4%).
OUT_RTOL, GRAD_RTOL = 0.02, 0.05


# --------------------------------------------------------------------------------------------
# implementations


def memfit_flash_attention() -> Callable:
    import memfit

    fn = getattr(memfit, "flash_attention", None)
    if fn is None:
        from memfit.ops.attention import flash_attention as fn
    return fn


_FLEX = None


def compiled_flex() -> Callable:
    global _FLEX
    if _FLEX is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        # one compiled graph per shape and mask: allow them all
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


_BLOCK_MASKS: dict = {}


def flex_block_mask(seqlen: int, causal: bool, window: int | None, device: torch.device):
    """None (dense) or a causal / causal sliding-window BlockMask, cached per shape."""
    if not causal and window is None:
        return None
    key = (seqlen, causal, window, str(device))
    if key not in _BLOCK_MASKS:
        from torch.nn.attention.flex_attention import create_block_mask

        if window is None:

            def mask_mod(b, h, q_idx, kv_idx):
                return q_idx >= kv_idx

        else:
            left = window - 1

            def mask_mod(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (q_idx - kv_idx <= left)

        # past 16k the dense (N, N) mask that the uncompiled path builds gets large
        _BLOCK_MASKS[key] = create_block_mask(
            mask_mod, None, None, seqlen, seqlen, device=device, _compile=seqlen > 16384
        )
    return _BLOCK_MASKS[key]


def sliding_window_mask(seqlen: int, window: int, device: torch.device) -> torch.Tensor:
    """(N, N) boolean, True where query i may see key j: i - window < j <= i."""
    i = torch.arange(seqlen, device=device)[:, None]
    j = torch.arange(seqlen, device=device)[None, :]
    return (j <= i) & (i - j < window)


def attention_fn(
    impl: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: int | None = None,
) -> Callable[[], torch.Tensor]:
    """A no-argument callable running `impl` on q, k, v ((B, N, H, D)) and returning (B, N, H, D).
    `window` (tokens a query sees, itself included) implies a causal sliding window."""
    seqlen = q.shape[1]
    if impl in ("memfit", "memfit-dense"):
        flash_attention = memfit_flash_attention()
        if window is None or impl == "memfit-dense":
            return lambda: flash_attention(q, k, v, causal=causal)
        win = (window - 1, 0)
        return lambda: flash_attention(q, k, v, causal=True, window=win)
    if impl.startswith("sdpa-"):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = {
            "sdpa-flash": SDPBackend.FLASH_ATTENTION,
            "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa-math": SDPBackend.MATH,
            "sdpa-mask": SDPBackend.EFFICIENT_ATTENTION,
        }[impl]
        mask = None
        if impl == "sdpa-mask" or window is not None:
            if impl != "sdpa-mask" or window is None:
                raise ValueError(f"{impl}: sliding window only through sdpa-mask")
            mask = sliding_window_mask(seqlen, window, q.device)

        def run() -> torch.Tensor:
            with sdpa_kernel(backend):
                out = F.scaled_dot_product_attention(
                    q.transpose(1, 2),
                    k.transpose(1, 2),
                    v.transpose(1, 2),
                    attn_mask=mask,
                    is_causal=causal and mask is None,
                )
            return out.transpose(1, 2)

        return run
    if impl == "flex":
        flex = compiled_flex()
        block_mask = flex_block_mask(seqlen, causal or window is not None, window, q.device)
        return lambda: flex(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask
        ).transpose(1, 2)
    raise ValueError(f"unknown implementation {impl!r}")


# --------------------------------------------------------------------------------------------
# measurement


def describe(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def make_inputs(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int = 0):
    """q, k, v (leaves requiring grad) and a fixed random grad_out, all of `shape`."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn() -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device, dtype=dtype)

    q, k, v = (randn().requires_grad_() for _ in range(3))
    return q, k, v, randn()


def times_ms(fn: Callable[[], object], *, warmup: int, repeat: int, cuda: bool) -> list[float]:
    """Milliseconds of each of `repeat` calls after `warmup` calls: the harness's CUDA-event timer,
    calls launched back to back (perf_counter on the CPU: a smoke test only)."""
    device = "cuda" if cuda else "cpu"
    return [t * 1e3 for t in time_calls(fn, warmup=warmup, repeat=repeat, device=device)]


def time_impl(impl, q, k, v, grad_out, *, causal, window, warmup, repeat) -> dict:
    """fwd_ms and fwd_bwd_ms ({p20, p50, p80}) of one implementation, or an error."""
    row: dict = {"impl": impl}
    cuda = q.device.type == "cuda"
    try:
        fwd = attention_fn(impl, q, k, v, causal=causal, window=window)
        row["fwd_ms"] = percentiles(times_ms(fwd, warmup=warmup, repeat=repeat, cuda=cuda))
        row["fwd_bwd_ms"] = percentiles(
            times_ms(
                lambda: torch.autograd.grad(fwd(), (q, k, v), grad_out),
                warmup=warmup,
                repeat=repeat,
                cuda=cuda,
            )
        )
    except Exception as error:  # recorded, the run goes on
        row["error"] = describe(error)
    free(q.device)
    return row


def check(test, reference, q, k, v, grad_out, *, causal, window) -> dict:
    """Max abs difference of `test`'s output and q/k/v gradients to `reference`'s."""
    result: dict = {"impl": test, "reference": reference}
    try:
        outs = []
        for impl in (test, reference):
            out = attention_fn(impl, q, k, v, causal=causal, window=window)()
            grads = torch.autograd.grad(out, (q, k, v), grad_out)
            outs.append((out.detach().float(), [g.float() for g in grads]))
        (out, grads), (ref, ref_grads) = outs
        result["out_max_abs_diff"] = (out - ref).abs().max().item()
        result["out_ref_max_abs"] = ref.abs().max().item()
        result["grad_max_abs_diff"] = (
            torch.stack([(g - r).abs().max() for g, r in zip(grads, ref_grads, strict=True)])
            .max()
            .item()
        )
        result["grad_ref_max_abs"] = torch.stack([r.abs().max() for r in ref_grads]).max().item()
        # NaN compares False: a NaN output is never ok
        result["ok"] = bool(
            result["out_max_abs_diff"] <= OUT_RTOL * result["out_ref_max_abs"]
            and result["grad_max_abs_diff"] <= GRAD_RTOL * result["grad_ref_max_abs"]
        )
    except Exception as error:
        result["error"] = describe(error)
    free(q.device)
    return result


def check_line(c: dict) -> str:
    if "error" in c:
        return f"check {c['impl']} vs {c['reference']}: error {c['error']}"
    return (
        f"check {c['impl']} vs {c['reference']}: out max|diff| {c['out_max_abs_diff']:.2e} "
        f"(ref max {c['out_ref_max_abs']:.2e}), grad max|diff| {c['grad_max_abs_diff']:.2e} "
        f"(ref max {c['grad_ref_max_abs']:.2e}) {'ok' if c['ok'] else '** MISMATCH **'}"
    )


def fwd_flops(batch: int, heads: int, seqlen: int, head_dim: int, causal: bool) -> float:
    return 4 * batch * heads * seqlen * seqlen * head_dim * (0.5 if causal else 1.0)


def fmt_ms(row: dict, key: str) -> str:
    return f"{row[key]['p50']:.3f}" if key in row else "-"


def throughput(args, dtype, device, run, save) -> None:
    rows, checks = run.setdefault("records", []), run.setdefault("checks", [])
    for head_dim in args.head_dims:
        heads = args.model_dim // head_dim
        for seqlen in args.seqlens:
            batch = max(1, args.tokens // seqlen)
            for causal in args.causal:
                shape = {
                    "head_dim": head_dim,
                    "seqlen": seqlen,
                    "batch": batch,
                    "heads": heads,
                    "causal": causal,
                }
                q, k, v, grad_out = make_inputs((batch, seqlen, heads, head_dim), dtype, device)
                print(f"D={head_dim} N={seqlen} B={batch} H={heads} causal={causal}", flush=True)
                if "memfit" in args.impls and args.check_reference:
                    c = {
                        **shape,
                        **check(
                            "memfit",
                            args.check_reference,
                            q,
                            k,
                            v,
                            grad_out,
                            causal=causal,
                            window=None,
                        ),
                    }
                    checks.append(c)
                    print("  " + check_line(c), flush=True)
                flops = fwd_flops(batch, heads, seqlen, head_dim, causal)
                for impl in args.impls:
                    if impl == "flex" and head_dim not in args.flex_head_dims:
                        continue
                    row = {**shape, "fwd_flops": flops, "fwd_bwd_flops": 3.5 * flops}
                    row.update(
                        time_impl(
                            impl,
                            q,
                            k,
                            v,
                            grad_out,
                            causal=causal,
                            window=None,
                            warmup=args.warmup,
                            repeat=args.repeat,
                        )
                    )
                    for key in ("fwd", "fwd_bwd"):
                        if f"{key}_ms" in row:
                            row[f"{key}_tflops"] = (
                                row[f"{key}_flops"] / (row[f"{key}_ms"]["p50"] * 1e-3) / 1e12
                            )
                    rows.append(row)
                    print(
                        f"  {impl:>11}: "
                        + (
                            f"fwd {row['fwd_tflops']:6.1f} TFLOP/s ({fmt_ms(row, 'fwd_ms')} ms)  "
                            if "fwd_tflops" in row
                            else ""
                        )
                        + (
                            f"fwd+bwd {row['fwd_bwd_tflops']:6.1f} TFLOP/s ({fmt_ms(row, 'fwd_bwd_ms')} ms)"
                            if "fwd_bwd_tflops" in row
                            else ""
                        )
                        + (f"ERROR {row['error']}" if "error" in row else ""),
                        flush=True,
                    )
                del q, k, v, grad_out
                free(device)
                save(run)


def window_section(args, dtype, device, run, save) -> None:
    rows, checks = run.setdefault("window", []), run.setdefault("checks", [])
    heads, head_dim = args.window_heads, args.window_head_dim
    for seqlen in args.window_seqlens:
        shape = {
            "window": args.window,
            "seqlen": seqlen,
            "batch": 1,
            "heads": heads,
            "head_dim": head_dim,
            "causal": True,
        }
        q, k, v, grad_out = make_inputs((1, seqlen, heads, head_dim), dtype, device)
        print(f"window {args.window} N={seqlen} H={heads} D={head_dim}", flush=True)
        impls = [i for i in args.window_impls if i != "sdpa-mask" or seqlen <= args.mask_max_seqlen]
        if "memfit" in impls:
            reference = "sdpa-mask" if "sdpa-mask" in impls else "flex"
            c = {
                **shape,
                **check("memfit", reference, q, k, v, grad_out, causal=True, window=args.window),
            }
            checks.append(c)
            print("  " + check_line(c), flush=True)
        for impl in impls:
            row = {**shape}
            row.update(
                time_impl(
                    impl,
                    q,
                    k,
                    v,
                    grad_out,
                    causal=True,
                    window=args.window,
                    warmup=args.warmup,
                    repeat=args.repeat,
                )
            )
            rows.append(row)
            print(
                f"  {impl:>12}: "
                + (f"fwd {fmt_ms(row, 'fwd_ms')} ms  " if "fwd_ms" in row else "")
                + (f"fwd+bwd {fmt_ms(row, 'fwd_bwd_ms')} ms" if "fwd_bwd_ms" in row else "")
                + (f"ERROR {row['error']}" if "error" in row else ""),
                flush=True,
            )
        del q, k, v, grad_out
        free(device)
        save(run)


def peak_extra(impl, q, k, v, grad_out) -> dict:
    """Peak bytes one forward+backward allocates over what was allocated before it (after one
    warm-up call, so compilation and autotuning are not counted), and its time."""
    row: dict = {"impl": impl}
    try:
        fwd = attention_fn(impl, q, k, v, causal=True)
        grads = torch.autograd.grad(fwd(), (q, k, v), grad_out)  # warm-up
        del grads
        free(q.device)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with cuda_span() as seconds:
            grads = torch.autograd.grad(fwd(), (q, k, v), grad_out)
        torch.cuda.synchronize()
        row["peak_extra_bytes"] = torch.cuda.max_memory_allocated() - base
        row["fwd_bwd_ms"] = seconds() * 1e3
        del grads
    except torch.cuda.OutOfMemoryError as error:
        row["oom"] = True
        row["error"] = describe(error)
    except Exception as error:
        row["error"] = describe(error)
    free(q.device)
    return row


def memory_section(args, dtype, device, run, save) -> None:
    rows = run.setdefault("memory", [])
    heads, head_dim = args.memory_heads, args.memory_head_dim
    for seqlen in args.memory_seqlens:
        q, k, v, grad_out = make_inputs((1, seqlen, heads, head_dim), dtype, device)
        inputs_bytes = 4 * q.numel() * q.element_size()
        print(f"memory N={seqlen} H={heads} D={head_dim} causal", flush=True)
        for impl in args.memory_impls:
            if impl == "sdpa-math" and seqlen > args.math_max_seqlen:
                continue
            row = {
                "seqlen": seqlen,
                "batch": 1,
                "heads": heads,
                "head_dim": head_dim,
                "causal": True,
                "inputs_bytes": inputs_bytes,
                **peak_extra(impl, q, k, v, grad_out),
            }
            rows.append(row)
            print(
                f"  {impl:>11}: "
                + (
                    f"peak extra {row['peak_extra_bytes'] / 2**20:,.0f} MiB, fwd+bwd {row['fwd_bwd_ms']:.1f} ms"
                    if "peak_extra_bytes" in row
                    else f"ERROR {row['error']}"
                ),
                flush=True,
            )
        del q, k, v, grad_out
        free(device)
        save(run)


# --------------------------------------------------------------------------------------------
# output


def latest(rows: list[dict], key: Callable[[dict], tuple]) -> dict:
    """Rows by key, a later row replacing an earlier one with the same key."""
    return {key(r): r for r in rows}


def tflops_cell(row: dict | None) -> str:
    if row is None:
        return ""
    if "fwd_tflops" not in row:
        return "error"
    bwd = f"{row['fwd_bwd_tflops']:.0f}" if "fwd_bwd_tflops" in row else "error"
    return f"{row['fwd_tflops']:.0f} / {bwd}"


def print_tables(run: dict, console: Console) -> None:
    gpu = run["env"].get("gpu", "?")
    rows = latest(
        run.get("records", []),
        lambda r: (r["head_dim"], r["seqlen"], r["causal"], r["impl"]),
    )
    if rows:
        impls = [i for i in IMPLS if any(r["impl"] == i for r in rows.values())]
        table = Table(title=f"attention TFLOP/s, fwd / fwd+bwd, B*N={run['tokens']}, {gpu}")
        for column in ("D", "N", "causal", *impls, "memfit/FA2", "memfit/flex", "check"):
            table.add_column(column)
        checks = latest(
            [c for c in run.get("checks", []) if "window" not in c],
            lambda c: (c["head_dim"], c["seqlen"], c["causal"]),
        )
        shapes = sorted({key[:3] for key in rows}, key=lambda s: (s[0], not s[2], s[1]))
        for d, n, causal in shapes:
            cells = [tflops_cell(rows.get((d, n, causal, i))) for i in impls]
            ratios = []
            for other in ("sdpa-flash", "flex"):
                a, b = rows.get((d, n, causal, "memfit")), rows.get((d, n, causal, other))
                ratios.append(
                    f"{a['fwd_tflops'] / b['fwd_tflops']:.2f} / {a['fwd_bwd_tflops'] / b['fwd_bwd_tflops']:.2f}"
                    if a and b and "fwd_bwd_tflops" in a and "fwd_bwd_tflops" in b
                    else ""
                )
            c = checks.get((d, n, causal))
            check_cell = (
                ""
                if c is None
                else "error"
                if "error" in c
                else f"{c['out_max_abs_diff']:.1e}{'' if c['ok'] else ' MISMATCH'}"
            )
            table.add_row(str(d), str(n), "yes" if causal else "no", *cells, *ratios, check_cell)
        console.print(table)
    if run.get("window"):
        table = Table(title=f"causal sliding window, milliseconds, {gpu}")
        for column in ("window", "N", "impl", "fwd ms", "fwd+bwd ms", "note"):
            table.add_column(column)
        for r in latest(run["window"], lambda r: (r["window"], r["seqlen"], r["impl"])).values():
            table.add_row(
                str(r["window"]),
                str(r["seqlen"]),
                r["impl"],
                fmt_ms(r, "fwd_ms"),
                fmt_ms(r, "fwd_bwd_ms"),
                r.get("error", "")[:100],
            )
        console.print(table)
    if run.get("memory"):
        table = Table(title=f"attention fwd+bwd peak extra memory, causal, {gpu}")
        for column in ("N", "impl", "peak extra", "fwd+bwd ms", "note"):
            table.add_column(column)
        for r in latest(run["memory"], lambda r: (r["seqlen"], r["impl"])).values():
            extra = r.get("peak_extra_bytes")
            table.add_row(
                str(r["seqlen"]),
                r["impl"],
                "OOM"
                if r.get("oom")
                else "error"
                if extra is None
                else f"{extra / 2**20:,.0f} MiB"
                if extra < 2**30
                else f"{extra / 2**30:.2f} GiB",
                f"{r['fwd_bwd_ms']:.1f}" if "fwd_bwd_ms" in r else "-",
                r.get("error", "")[:100],
            )
        console.print(table)


def plot(run: dict, path: Path) -> Path | None:
    """TFLOP/s against N: a column per (D, causal), forward+backward on top, forward below."""
    rows = [r for r in run.get("records", []) if "fwd_tflops" in r]
    if not rows:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    rows = list(
        latest(rows, lambda r: (r["head_dim"], r["seqlen"], r["causal"], r["impl"])).values()
    )
    combos = sorted({(r["head_dim"], r["causal"]) for r in rows}, key=lambda c: (c[0], not c[1]))
    seqlens = sorted({r["seqlen"] for r in rows})
    fig, axes = plt.subplots(
        2, len(combos), figsize=(4.2 * len(combos), 7.5), squeeze=False, sharex=True
    )
    handles: dict = {}
    for col, (head_dim, causal) in enumerate(combos):
        for line, (key, label) in enumerate(
            (("fwd_bwd_tflops", "forward+backward"), ("fwd_tflops", "forward"))
        ):
            ax = axes[line][col]
            for impl in IMPLS:
                points = sorted(
                    (r["seqlen"], r[key])
                    for r in rows
                    if r["impl"] == impl
                    and r["head_dim"] == head_dim
                    and r["causal"] == causal
                    and key in r
                )
                if points:
                    (handles[impl],) = ax.plot(
                        [p[0] for p in points],
                        [p[1] for p in points],
                        marker="o",
                        color=f"C{IMPLS.index(impl)}",
                        label=impl,
                    )
            ax.set_xscale("log", base=2)
            ax.set_xticks(seqlens, [f"{n // 1024}k" if n >= 1024 else str(n) for n in seqlens])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.set_title(f"{label}, D={head_dim}, {'causal' if causal else 'not causal'}")
            if line == 1:
                ax.set_xlabel("sequence length N")
            if col == 0:
                ax.set_ylabel("TFLOP/s")
    names = [i for i in IMPLS if i in handles]
    fig.legend([handles[i] for i in names], names, loc="lower center", ncol=len(names))
    env = run["env"]
    fig.suptitle(
        f"attention, B*N = {run['tokens']} tokens, H*D = {run['model_dim']}, {run['dtype']}, "
        f"{env.get('gpu', '?')}, torch {env['torch']}, commit {env['commit']}"
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------------


def add_shape_options(
    group: argparse._ArgumentGroup, section: str, *, max_seqlen_option: str, max_seqlen_help: str
) -> None:
    """A section's --SECTION-heads and --SECTION-head-dim (default 16 x 128), and the longest
    sequence its dense (N x N) implementation runs at (default 16k)."""
    group.add_argument(f"--{section}-heads", type=int, default=16)
    group.add_argument(f"--{section}-head-dim", type=int, default=128)
    group.add_argument(max_seqlen_option, type=int, default=16384, help=max_seqlen_help)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls (default 20)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--device", default="cuda", help="cuda; cpu only smoke-tests this script (memory: skipped)"
    )
    group = parser.add_argument_group("throughput")
    group.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    group.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    group.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    group.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    group.add_argument("--tokens", type=int, default=16384, help="B*N (default 16384)")
    group.add_argument("--model-dim", type=int, default=2048, help="H*D (default 2048)")
    group.add_argument(
        "--flex-head-dims",
        type=int,
        nargs="*",
        default=[128],
        help="head dims at which flex runs (it compiles per shape; default 128)",
    )
    group.add_argument(
        "--check-reference",
        default="sdpa-flash",
        choices=("sdpa-flash", "sdpa-cudnn", "sdpa-math", "flex", ""),
        help="what memfit's output and gradients are compared with per shape ('' for no check)",
    )
    group = parser.add_argument_group("sliding window")
    group.add_argument(
        "--window", type=int, default=1024, help="keys a query sees, itself included"
    )
    group.add_argument("--window-seqlens", type=int, nargs="+", default=[8192, 16384])
    group.add_argument(
        "--window-impls", nargs="+", choices=WINDOW_IMPLS, default=list(WINDOW_IMPLS)
    )
    add_shape_options(
        group,
        "window",
        max_seqlen_option="--mask-max-seqlen",
        max_seqlen_help="sdpa-mask (dense, explicit (N, N) mask) only up to this N",
    )
    group = parser.add_argument_group("memory")
    group.add_argument(
        "--memory-seqlens",
        type=int,
        nargs="+",
        default=[4096, 8192, 16384, 32768, 65536, 131072],
    )
    group.add_argument(
        "--memory-impls",
        nargs="+",
        choices=MEMORY_IMPLS,
        default=["memfit", "sdpa-flash", "sdpa-cudnn", "sdpa-math"],
    )
    add_shape_options(
        group,
        "memory",
        max_seqlen_option="--math-max-seqlen",
        max_seqlen_help="sdpa-math (materializes N x N) only up to this N (64 GiB at 16k)",
    )
    group = parser.add_argument_group("output")
    group.add_argument(
        "--out",
        type=Path,
        default=harness.RESULTS,
        help="directory of attention.json and attention_tflops.png (default benchmarks/results). "
        "If it has no attention.json yet, the repository's is copied there first, so that "
        "OUT/attention.json can replace it as it is.",
    )
    group.add_argument("--no-save", action="store_true", help="write no attention.json")
    group.add_argument("--no-plot", action="store_true", help="write no attention_tflops.png")
    args = parser.parse_args(argv)
    args.causal = {"both": [True, False], "yes": [True], "no": [False]}[args.causal]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU (--device cpu: smoke test)")
    dtype = DTYPES[args.dtype]
    out_dir: Path = args.out.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = out_dir / "attention.partial.json"

    run = {
        "benchmark": "attention",
        "env": environment(),
        "warmup": args.warmup,
        "repeat": args.repeat,
        "dtype": args.dtype,
        "tokens": args.tokens,
        "model_dim": args.model_dim,
        "window_size": args.window,
        "sections": args.sections,
    }

    def save(run: dict) -> None:
        partial.write_text(json.dumps(run, indent=2) + "\n")

    started = time.perf_counter()
    torch.manual_seed(0)
    for section in args.sections:
        if section == "memory" and device.type != "cuda":
            print("memory: skipped (needs CUDA)")
            continue
        section_start = time.perf_counter()
        measure = {"throughput": throughput, "window": window_section, "memory": memory_section}
        try:
            measure[section](args, dtype, device, run, save)
        except Exception as error:  # a bug here must not lose the other sections' numbers
            traceback.print_exc()
            run.setdefault("section_errors", {})[section] = describe(error)
            free(device)
        run.setdefault("seconds", {})[section] = round(time.perf_counter() - section_start, 1)
        print(f"{section}: {run['seconds'][section]:.0f} s", flush=True)
    run.setdefault("seconds", {})["total"] = round(time.perf_counter() - started, 1)

    if not args.no_save:
        if out_dir != harness.RESULTS.resolve():
            seed = harness.RESULTS / "attention.json"
            if seed.exists() and not (out_dir / "attention.json").exists():
                shutil.copy(seed, out_dir / "attention.json")
            harness.RESULTS = out_dir
        print("wrote", append_results("attention", run))
    try:
        print_tables(run, Console(width=180))
        if not args.no_plot:
            path = plot(run, out_dir / "attention_tflops.png")
            if path:
                print("wrote", path)
    except Exception:
        traceback.print_exc()
    bad = [c for c in run.get("checks", []) if not c.get("ok")]
    if bad:
        print(f"** {len(bad)} correctness check(s) failed or errored: see 'checks' **")
    partial.unlink(missing_ok=True)
    print(f"total {run['seconds']['total']:.0f} s")


if __name__ == "__main__":
    main()
