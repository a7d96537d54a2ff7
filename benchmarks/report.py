"""Regenerate the tables of BENCHMARKS.md from benchmarks/results/*.json.

Each table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` markers; the text around
them is written by hand. A table comes from the newest run of its results file that has its data,
with the records of other such runs of the same commit merged in (a benchmark split over calls).
The attention tables (attention, attention_memory, attention_window, attention_train) are
optional: where BENCHMARKS.md has no markers for one, it is printed instead of written.

    python benchmarks/report.py
    python benchmarks/report.py --results /tmp/results --dry-run   # print the tables, write nothing
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
DOC = ROOT.parent / "BENCHMARKS.md"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _env_line(run: dict, extra: str, *, transformers: bool = False) -> str:
    env = run["env"]
    tf = f", transformers {env.get('transformers', '-')}" if transformers else ""
    return (
        f"Measured {env['date'][:10]} on {env.get('gpu', '?')}, torch {env['torch']}, "
        f"triton {env.get('triton', '-')}{tf}, commit {env['commit']}; {extra}"
    )


def _latest(rows: list[dict], key: Callable[[dict], tuple]) -> list[dict]:
    """`rows` without the earlier of rows sharing a key (a setting measured twice: the later)."""
    return list({key(r): r for r in rows}.values())


def _attention(record: dict) -> str:
    """A train_step record's attention backend (records from before the option: sdpa)."""
    return record.get("attention", "sdpa")


def _train_key(r: dict) -> tuple:
    return (r.get("seq_len", 2048), r["checkpointing"], r["micro_batch"])


def plain_train_run(run: dict) -> bool:
    """A train_step run of the issue-2 comparison: SDPA attention, sequence 2048 only."""
    return run.get("attention", ["sdpa"]) == ["sdpa"] and run.get("seq_lens", [2048]) == [2048]


def train_step_table(run: dict) -> str:
    lines = [
        _env_line(
            run,
            f"median of {run['repeat']} steps after {run['warmup']} warm-up steps.",
            transformers=True,
        ),
        "",
        "| checkpointing | micro-batch | system | tokens/s | MFU | peak allocated (GiB) | tokens/s vs HF | memory vs HF |",
        "|---|---|---|---|---|---|---|---|",
    ]
    records = _latest(
        [r for r in run["records"] if _attention(r) == "sdpa" and r.get("seq_len", 2048) == 2048],
        lambda r: (*_train_key(r), r["system"]),
    )
    for r in records:
        name = {
            "hf": "HF LlamaForCausalLM",
            "memfit": "**memfit** (default: compiled)"
            if r.get("compiled")
            else "**memfit** (default: eager)",
            "memfit-eager": "memfit, --compile off",
            "memfit-compiled": "memfit, --compile on",
        }.get(r["system"], r["system"])
        if "error" in r:
            lines.append(
                f"| {r['checkpointing']} | {r['micro_batch']} | {name} | error: {r['error'][:80]} | | | | |"
            )
            continue
        base = next(
            (
                b
                for b in records
                if b["system"] == "hf" and _train_key(b) == _train_key(r) and "error" not in b
            ),
            None,
        )
        vs = (
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{r['peak_allocated_bytes'] / base['peak_allocated_bytes']:.2f}x"
            if base
            else "- | -"
        )
        lines.append(
            f"| {r['checkpointing']} | {r['micro_batch']} | {name} | {r['tokens_per_s']:,.0f} | {r['mfu']:.2f} | "
            f"{_gib(r['peak_allocated_bytes'])} | {vs} |"
        )
    return "\n".join(lines)


def attention_train_table(run: dict) -> str:
    """llama-1b training with memfit's FlashAttention against SDPA (train_step.py --attention)."""
    lines = [
        _env_line(
            run,
            f"median of {run['repeat']} steps after {run['warmup']} warm-up steps; micro-batch "
            "scaled with the sequence so that every step holds the same tokens.",
            transformers=True,
        ),
        "",
        "| seq | micro-batch | checkpointing | system | attention | tokens/s | MFU | peak allocated (GiB) | tokens/s vs SDPA | memory vs SDPA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    records = _latest(run["records"], lambda r: (*_train_key(r), r["system"], _attention(r)))
    order = {"hf": 0, "memfit": 1, "memfit-eager": 2, "memfit-compiled": 3}
    attention_order = {"sdpa": 0, "auto": 1, "flash": 2}
    records.sort(
        key=lambda r: (
            *_train_key(r),
            order.get(r["system"], 9),
            attention_order.get(_attention(r), 9),
        )
    )
    systems = {
        "hf": "HF LlamaForCausalLM",
        "memfit": "memfit",
        "memfit-eager": "memfit, --compile off",
        "memfit-compiled": "memfit, --compile on",
    }
    backends = {
        "sdpa": "torch SDPA",
        "flash": "**memfit FlashAttention**",
    }
    for r in records:
        seq, ckpt, mb = _train_key(r)
        attention = backends.get(_attention(r), _attention(r))
        if "attention_resolved" in r:
            attention += f" ({r['attention_resolved']})"
        head = f"| {seq} | {mb} | {ckpt} | {systems.get(r['system'], r['system'])} | {attention} |"
        if "error" in r:
            lines.append(f"{head} error: {r['error'][:80]} | | | | |")
            continue
        base = next(
            (
                b
                for b in records
                if b["system"] == r["system"]
                and r["system"] != "hf"
                and _attention(b) == "sdpa"
                and _train_key(b) == _train_key(r)
                and "error" not in b
            ),
            None,
        )
        vs = (
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{r['peak_allocated_bytes'] / base['peak_allocated_bytes']:.2f}x"
            if base
            else "- | -"
        )
        lines.append(
            f"{head} {r['tokens_per_s']:,.0f} | {r['mfu']:.2f} | {_gib(r['peak_allocated_bytes'])} | {vs} |"
        )
    return "\n".join(lines)


def planner_accuracy_table(run: dict) -> str:
    lines = [
        _env_line(run, f"peak = max_memory_allocated over steps 2..{run['steps']}."),
        "",
        "| model | strategy | predicted peak (GiB) | measured peak (GiB) | error | predicted fits / ran out of memory |",
        "|---|---|---|---|---|---|",
    ]
    for r in run["records"]:
        parts = r["strategy"].split(", ")
        r = {
            **r,
            "strategy": ", ".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1]),
        }
        measured = "OOM" if r["measured_oom"] else f"{r['measured_peak_bytes'] / 2**30:.2f}"
        error = "-" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['predicted_peak_bytes'] / 2**30:.2f} | {measured} | {error} | "
            f"{'yes' if r['predicted_fits'] else 'no'} / {'yes' if r['measured_oom'] else 'no'} |"
        )
    return "\n".join(lines)


ATTENTION_IMPLS = {
    "memfit": "**memfit**",
    "sdpa-flash": "SDPA-flash (FA2)",
    "sdpa-cudnn": "SDPA-cuDNN",
    "flex": "FlexAttention",
}
WINDOW_IMPLS = {
    "memfit": "**memfit**",
    "flex": "FlexAttention",
    "sdpa-mask": "SDPA mem-efficient, explicit mask",
    "memfit-dense": "memfit, causal without window",
}
MEMORY_IMPLS = {
    "memfit": "**memfit**",
    "sdpa-flash": "SDPA-flash (FA2)",
    "sdpa-cudnn": "SDPA-cuDNN",
    "sdpa-math": "SDPA-math (naive)",
    "flex": "FlexAttention",
}


def _attention_env(run: dict, extra: str) -> str:
    return _env_line(
        run,
        f"{run.get('dtype', 'bf16')}, (B, N, H, D) inputs; CUDA-event times, median of "
        f"{run['repeat']} calls after {run['warmup']} warm-up calls{extra}.",
    )


def _pair(a: float | None, b: float | None, fmt: str) -> str:
    return " / ".join("error" if x is None else format(x, fmt) for x in (a, b))


def _size(n: float) -> str:
    return f"{n / 2**20:,.0f} MiB" if n < 2**30 else f"{n / 2**30:.1f} GiB"


def attention_table(run: dict) -> str:
    """Throughput sweep of benchmarks/attention.py: TFLOP/s per implementation per shape."""
    rows = {
        (r["head_dim"], r["seqlen"], r["causal"], r["impl"]): r
        for r in _latest(
            run["records"], lambda r: (r["head_dim"], r["seqlen"], r["causal"], r["impl"])
        )
    }
    checks = {
        (c["head_dim"], c["seqlen"], c["causal"]): c
        for c in run.get("checks", [])
        if "window" not in c
    }
    impls = [i for i in ATTENTION_IMPLS if any(key[3] == i for key in rows)]
    tokens, model_dim = run.get("tokens", 16384), run.get("model_dim", 2048)
    lines = [
        _attention_env(
            run,
            f"; B·N = {tokens} tokens, H·D = {model_dim}. TFLOP/s forward / forward+backward, "
            "FLOPs forward 4·B·H·N²·D (halved when causal), forward+backward 3.5x forward",
        ),
        "",
        "| D | N | causal | "
        + " | ".join(ATTENTION_IMPLS[i] for i in impls)
        + " | memfit vs FA2 | memfit vs Flex | memfit max abs diff vs "
        + (next(iter(checks.values()))["reference"] if checks else "reference")
        + " (out / grads) |",
        "|---|---|---|" + "---|" * (len(impls) + 3),
    ]

    def tflops(r: dict | None) -> str:
        if r is None:
            return ""
        if "fwd_tflops" not in r:
            return "error"
        return _pair(r.get("fwd_tflops"), r.get("fwd_bwd_tflops"), ".0f")

    def ratio(a: dict | None, b: dict | None) -> str:
        if not a or not b or "fwd_tflops" not in a or "fwd_tflops" not in b:
            return ""
        bwd = (
            a["fwd_bwd_tflops"] / b["fwd_bwd_tflops"]
            if "fwd_bwd_tflops" in a and "fwd_bwd_tflops" in b
            else None
        )
        return _pair(a["fwd_tflops"] / b["fwd_tflops"], bwd, ".2f")

    for d, n, causal in sorted({k[:3] for k in rows}, key=lambda k: (k[0], not k[2], k[1])):
        memfit = rows.get((d, n, causal, "memfit"))
        c = checks.get((d, n, causal))
        if c is None:
            check = ""
        elif "error" in c:
            check = "error"
        else:
            check = f"{c['out_max_abs_diff']:.1e} / {c['grad_max_abs_diff']:.1e}" + (
                "" if c.get("ok") else " **MISMATCH**"
            )
        cells = [tflops(rows.get((d, n, causal, i))) for i in impls]
        cells += [ratio(memfit, rows.get((d, n, causal, "sdpa-flash")))]
        cells += [ratio(memfit, rows.get((d, n, causal, "flex"))), check]
        lines.append(f"| {d} | {n} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attention_memory_table(run: dict) -> str:
    rows = {
        (r["seqlen"], r["impl"]): r
        for r in _latest(run["memory"], lambda r: (r["seqlen"], r["impl"]))
    }
    impls = [i for i in MEMORY_IMPLS if any(key[1] == i for key in rows)]
    first = next(iter(rows.values()))
    lines = [
        _env_line(
            run,
            f"causal, B=1, H={first['heads']}, D={first['head_dim']}, {run.get('dtype', 'bf16')}: "
            "peak bytes allocated by one forward+backward over what was allocated before it "
            "(q, k, v and grad_out); '-' not run.",
        ),
        "",
        "| N | " + " | ".join(MEMORY_IMPLS[i] for i in impls) + " | memfit fwd+bwd (ms) |",
        "|---|" + "---|" * (len(impls) + 1),
    ]
    for n in sorted({key[0] for key in rows}):
        cells = []
        for impl in impls:
            r = rows.get((n, impl))
            if r is None:
                cells.append("-")
            elif r.get("oom"):
                cells.append("OOM")
            elif "peak_extra_bytes" not in r:
                cells.append("error")
            else:
                cells.append(_size(r["peak_extra_bytes"]))
        memfit = rows.get((n, "memfit"), {})
        cells.append(f"{memfit['fwd_bwd_ms']:.1f}" if "fwd_bwd_ms" in memfit else "-")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def attention_window_table(run: dict) -> str:
    rows = {
        (r["window"], r["seqlen"], r["impl"]): r
        for r in _latest(run["window"], lambda r: (r["window"], r["seqlen"], r["impl"]))
    }
    checks = {(c["window"], c["seqlen"]): c for c in run.get("checks", []) if "window" in c}
    impls = [i for i in WINDOW_IMPLS if any(key[2] == i for key in rows)]
    first = next(iter(rows.values()))
    lines = [
        _attention_env(
            run,
            f"; causal sliding window, B=1, H={first['heads']}, D={first['head_dim']}; "
            "milliseconds forward / forward+backward",
        ),
        "",
        "| window | N | "
        + " | ".join(WINDOW_IMPLS[i] for i in impls)
        + " | memfit vs Flex (time) | memfit max abs diff (out / grads) |",
        "|---|---|" + "---|" * (len(impls) + 2),
    ]

    def ms(r: dict | None) -> str:
        if r is None:
            return "-"
        if "fwd_ms" not in r:
            return "error"
        return _pair(
            r["fwd_ms"]["p50"], r["fwd_bwd_ms"]["p50"] if "fwd_bwd_ms" in r else None, ".2f"
        )

    for window, n in sorted({key[:2] for key in rows}):
        memfit, flex = rows.get((window, n, "memfit")), rows.get((window, n, "flex"))
        if memfit and flex and "fwd_bwd_ms" in memfit and "fwd_bwd_ms" in flex:
            vs = _pair(
                memfit["fwd_ms"]["p50"] / flex["fwd_ms"]["p50"],
                memfit["fwd_bwd_ms"]["p50"] / flex["fwd_bwd_ms"]["p50"],
                ".2f",
            )
        else:
            vs = ""
        c = checks.get((window, n))
        if c is None:
            check = ""
        elif "error" in c:
            check = "error"
        else:
            check = (
                f"{c['out_max_abs_diff']:.1e} / {c['grad_max_abs_diff']:.1e} vs {c['reference']}"
                + ("" if c.get("ok") else " **MISMATCH**")
            )
        cells = [ms(rows.get((window, n, i))) for i in impls] + [vs, check]
        lines.append(f"| {window} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


_SYSTEM_NAMES = {
    "ddp": "torch DDP",
    "zero0": "**memfit ZeRO-0** (data parallel)",
    "zero1": "**memfit ZeRO-1**",
    "zero2": "**memfit ZeRO-2**",
    "zero3": "**memfit ZeRO-3**",
    "fsdp2": "torch FSDP2 (`fully_shard` per block)",
    "zero0+offload": "**memfit `--offload optimizer`**",
    "zero3+offload": "**memfit ZeRO-3 `--offload params`**",
}


def zero_table(run: dict) -> str:
    """Data-parallel systems per preset: tokens/s per GPU, peak per rank, planned peak."""
    records = run["records"]
    gpus = next((r["gpus"] for r in records if "gpus" in r), "?")
    lines = [
        _env_line(run, f"{gpus} GPU{'s' if gpus != 1 else ''}, seq 2048, bf16 autocast, median "
                  f"of {run['repeat']} steps after {run['warmup']} warm-up steps; peak = "
                  "max_memory_allocated per rank over the training steps."),
        "",
        "| model | micro-batch | checkpointing | system | tokens/s per GPU | vs DDP | peak per rank "
        "(GiB) | memfit planned (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    ddp = {r["model"]: r.get("tokens_per_s_per_gpu") for r in records if r["system"] == "ddp"}
    for r in records:
        name = _SYSTEM_NAMES.get(r["system"], r["system"])
        if "error" in r:
            lines.append(f"| {r['model']} | | | {name} | {r['error'][:80]} | | | |")
            continue
        speed = r["tokens_per_s_per_gpu"]
        base = ddp.get(r["model"])
        ratio = f"{speed / base:.2f}x" if base else "-"
        peak = max(r["peak_allocated_per_rank"])
        planned = _gib(r["planned_peak_bytes"]) if "planned_peak_bytes" in r else "-"
        lines.append(
            f"| {r['model']} | {r['micro_batch']} | {r['checkpointing']} | {name} | {speed:,.0f} "
            f"| {ratio} | {_gib(peak)} | {planned} |"
        )
    return "\n".join(lines)


def _gpus(run: dict) -> int:
    """The number of GPUs of a zero.py run (0 for a run without records)."""
    return max((r.get("gpus", 0) for r in run.get("records", [])), default=0)


def _has(key: str) -> Callable[[dict], bool]:
    return lambda run: bool(run.get(key))


# name: (results file, render, which runs of the file count, optional)
TABLES: dict[str, tuple[str, Callable[[dict], str], Callable[[dict], bool], bool]] = {
    "train_step": ("train_step", train_step_table, plain_train_run, False),
    "planner_accuracy": ("planner_accuracy", planner_accuracy_table, _has("records"), False),
    "attention": ("attention", attention_table, _has("records"), True),
    "attention_memory": ("attention", attention_memory_table, _has("memory"), True),
    "attention_window": ("attention", attention_window_table, _has("window"), True),
    "attention_train": (
        "train_step",
        attention_train_table,
        lambda run: not plain_train_run(run),
        True,
    ),
    "zero": ("zero", zero_table, lambda run: _gpus(run) > 1, True),
    "zero_offload": ("zero", zero_table, lambda run: _gpus(run) == 1, True),
}
MERGED = ("records", "checks", "window", "memory")


def newest(runs: list[dict]) -> dict:
    """The newest run, with the lists of the other runs of its commit merged in (older first)."""
    run = dict(runs[-1])
    same = [r for r in runs if r["env"]["commit"] == run["env"]["commit"]]
    for key in MERGED:
        if key in run:
            run[key] = [row for r in same for row in r.get(key, [])]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder of the JSON files")
    parser.add_argument("--doc", type=Path, default=DOC, help="the Markdown file to update")
    parser.add_argument("--dry-run", action="store_true", help="print every table; write nothing")
    args = parser.parse_args()
    text = args.doc.read_text()
    for name, (file, render, counts, optional) in TABLES.items():
        path = args.results / f"{file}.json"
        if not path.exists():
            continue
        runs = [run for run in json.loads(path.read_text()) if counts(run)]
        if not runs:
            continue
        table = render(newest(runs))
        pattern = re.compile(rf"(<!-- table:{name} -->).*?(<!-- /table:{name} -->)", re.S)
        if not pattern.search(text):
            if not optional:
                raise SystemExit(f"{args.doc.name} has no <!-- table:{name} --> markers")
            print(f"{args.doc.name} has no <!-- table:{name} --> markers; the table would be:")
            print(f"<!-- table:{name} -->\n{table}\n<!-- /table:{name} -->\n")
            continue
        if args.dry_run:
            print(f"<!-- table:{name} -->\n{table}\n<!-- /table:{name} -->\n")
        text = pattern.sub(
            lambda m, table=table: m.group(1) + "\n" + table + "\n" + m.group(2), text
        )
    if args.dry_run:
        return
    args.doc.write_text(text)
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
