"""Regenerate the tables of BENCHMARKS.md from benchmarks/results/*.json.

Each table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` markers; the text around
them is written by hand. Tables come from the newest run in each results file.

    python benchmarks/report.py
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
DOC = ROOT.parent / "BENCHMARKS.md"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def train_step_table(run: dict) -> str:
    env = run["env"]
    lines = [
        f"Measured {env['date'][:10]} on {env.get('gpu', '?')}, torch {env['torch']}, triton {env.get('triton', '-')}, "
        f"transformers {env.get('transformers', '-')}, commit {env['commit']}; median of {run['repeat']} steps after "
        f"{run['warmup']} warm-up steps.",
        "",
        "| checkpointing | micro-batch | system | tokens/s | MFU | peak allocated (GiB) | tokens/s vs HF | memory vs HF |",
        "|---|---|---|---|---|---|---|---|",
    ]
    records = run["records"]
    for r in records:
        base = next(
            b
            for b in records
            if b["system"] == "hf"
            and b["micro_batch"] == r["micro_batch"]
            and b["checkpointing"] == r["checkpointing"]
        )
        name = {
            "hf": "HF LlamaForCausalLM",
            "memfit": "**memfit** (default: compiled)"
            if r.get("compiled")
            else "**memfit** (default: eager)",
            "memfit-eager": "memfit, --compile off",
            "memfit-compiled": "memfit, --compile on",
        }.get(r["system"], r["system"])
        lines.append(
            f"| {r['checkpointing']} | {r['micro_batch']} | {name} | {r['tokens_per_s']:,.0f} | {r['mfu']:.2f} | "
            f"{_gib(r['peak_allocated_bytes'])} | {r['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
            f"{r['peak_allocated_bytes'] / base['peak_allocated_bytes']:.2f}x |"
        )
    return "\n".join(lines)


def planner_accuracy_table(run: dict) -> str:
    env = run["env"]
    lines = [
        f"Measured {env['date'][:10]} on {env.get('gpu', '?')}, torch {env['torch']}, triton {env.get('triton', '-')}, "
        f"commit {env['commit']}; peak = max_memory_allocated over steps 2..{run['steps']}.",
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


TABLES = {"train_step": train_step_table, "planner_accuracy": planner_accuracy_table}


def main() -> None:
    text = DOC.read_text()
    for name, render in TABLES.items():
        path = RESULTS / f"{name}.json"
        if not path.exists():
            continue
        runs = json.loads(path.read_text())
        # the newest run, with the records of other runs of the same commit (a benchmark split
        # over several calls) merged in
        newest = dict(runs[-1])
        newest["records"] = [
            r
            for run in runs
            if run["env"]["commit"] == newest["env"]["commit"]
            for r in run["records"]
        ]
        table = render(newest)
        pattern = re.compile(rf"(<!-- table:{name} -->).*?(<!-- /table:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"BENCHMARKS.md has no <!-- table:{name} --> markers")
        text = pattern.sub(
            lambda m, table=table: m.group(1) + "\n" + table + "\n" + m.group(2), text
        )
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
