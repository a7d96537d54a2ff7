"""Regenerate the tables of BENCHMARKS.md from benchmarks/results/*.json.

Each table sits between `<!-- table:NAME -->` and `<!-- /table:NAME -->` markers; the text around
them is written by hand. A table comes from the newest run of its results file that has its data,
with the records of other such runs of the same commit merged in (a benchmark split over calls).
The attention tables (attention, attention_memory, attention_window, attention_train) are
optional: where BENCHMARKS.md has no markers for one, it is printed instead of written.

A measured run is shown against the prediction recorded with it (zero.py stores the planner's
peak and step time before each job; planner_accuracy.py its predicted peaks), never re-planned by
today's planner, whose model may since have been fitted to that very run: '-' where a record
holds no prediction. Today's planner only fills in what was not measured (the scaling table's
4 and 8 GPUs, its efficiency from planned figures, the plot's dashed lines).

    python benchmarks/report.py
    python benchmarks/report.py --results /tmp/results --dry-run   # print the tables, write nothing
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from functools import partial
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


def _versus(record: dict, records: list[dict], is_base: Callable[[dict, dict], bool]) -> str:
    """Two cells: `record`'s tokens/s and peak against the first record of the same setting
    (sequence, checkpointing, micro-batch) that `is_base(candidate, record)` picks and that did
    not fail."""
    base = next(
        (
            b
            for b in records
            if is_base(b, record) and _train_key(b) == _train_key(record) and "error" not in b
        ),
        None,
    )
    if base is None:
        return "- | -"
    return (
        f"{record['tokens_per_s'] / base['tokens_per_s']:.2f}x | "
        f"{record['peak_allocated_bytes'] / base['peak_allocated_bytes']:.2f}x"
    )


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
        vs = _versus(r, records, lambda base, r: base["system"] == "hf")
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
        vs = _versus(
            r,
            records,
            lambda base, r: base["system"] == r["system"] != "hf" and _attention(base) == "sdpa",
        )
        lines.append(
            f"{head} {r['tokens_per_s']:,.0f} | {r['mfu']:.2f} | {_gib(r['peak_allocated_bytes'])} | {vs} |"
        )
    return "\n".join(lines)


def planner_accuracy_table(run: dict) -> str:
    """The latest measurement of every configuration (a run of some of them, `--match`,
    replaces only theirs), each with its commit and date."""

    def strategy(text: str) -> str:  # (older runs named the optimizer twice)
        parts = text.split(", ")
        return ", ".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])

    records = [
        {**record, "strategy": strategy(record["strategy"]), "commit": r["env"]["commit"],
         "date": r["env"]["date"][:10]}
        for r in run.get("all_runs", [run])
        for record in r["records"]
    ]  # fmt: skip
    records = _latest(records, key=lambda r: (r["model"], r["strategy"]))
    lines = [
        _env_line(run, f"peak = max_memory_allocated over steps 2..{run['steps']}.")
        + " Each row is the latest run of its configuration: its commit and date in the last column.",
        "",
        "| model | strategy | predicted peak (GiB) | measured peak (GiB) | error | predicted fits / ran out of memory | run |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        measured = "OOM" if r["measured_oom"] else f"{r['measured_peak_bytes'] / 2**30:.2f}"
        error = "-" if r["error"] is None else f"{r['error']:+.1%}"
        lines.append(
            f"| {r['model']} | {r['strategy']} | {r['predicted_peak_bytes'] / 2**30:.2f} | {measured} | {error} | "
            f"{'yes' if r['predicted_fits'] else 'no'} / {'yes' if r['measured_oom'] else 'no'} | "
            f"{r['commit']}, {r['date']} |"
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


def _check_cell(check: dict | None, *, reference: bool = False) -> str:
    """memfit's max abs difference to the reference implementation, output / gradients."""
    if check is None:
        return ""
    if "error" in check:
        return "error"
    return (
        f"{check['out_max_abs_diff']:.1e} / {check['grad_max_abs_diff']:.1e}"
        + (f" vs {check['reference']}" if reference else "")
        + ("" if check.get("ok") else " **MISMATCH**")
    )


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
        check = _check_cell(checks.get((d, n, causal)))
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
        check = _check_cell(checks.get((window, n)), reference=True)
        cells = [ms(rows.get((window, n, i))) for i in impls] + [vs, check]
        lines.append(f"| {window} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


PLANNED_AS = {"ddp": "zero0", "fsdp2": "zero3"}  # torch's systems, planned as memfit's stage
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


def zero_table(run: dict, *, offload: bool = False) -> str:
    """Data-parallel systems per preset at the newest run's number of GPUs: tokens/s per GPU,
    peak per rank, and the planner's peak and step time. Each (model, system) from the newest run
    that measured it (with `offload`: the offload systems only)."""
    gpus = _gpus(run)
    rows: dict = {}
    for other in run["all_runs"]:
        for r in other["records"]:
            if (
                r.get("gpus") == gpus
                and ("offload" in r["system"]) == offload
                and "skipped" not in r
            ):
                key = (r["model"], r["system"], r["micro_batch"], r.get("grad_accum", 1))
                rows[key] = (other, r)
    runs = {id(other): other for other, _ in rows.values()}.values()
    commits = ", ".join(dict.fromkeys(other["env"]["commit"] for other in runs))
    lines = [
        _env_line(run, f"{gpus} GPU{'s' if gpus != 1 else ''}, seq 2048, bf16 autocast, median "
                  "step after warm-up (counts per run in zero.json); peak = max_memory_allocated "
                  "per rank over the training steps; each row from the newest run that measured "
                  f"it (commits {commits}); planned: what `memfit plan` and its time model "
                  "predicted when the run was made, recorded in zero.json before each job ('-': "
                  "the record has no prediction; DDP's step planned as stage 0, FSDP2's as "
                  "stage 3)."),
        "",
        "| model | micro-batch | checkpointing | system | tokens/s per GPU | vs DDP | peak per rank "
        "(GiB) | memfit planned (GiB) | step (s) | planned step (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    order = {name: index for index, name in enumerate(_SYSTEM_NAMES)}
    models = list(dict.fromkeys(r["model"] for _, r in rows.values()))
    records = sorted(
        (r for _, r in rows.values()),
        key=lambda r: (
            models.index(r["model"]),
            r["micro_batch"],
            r.get("grad_accum", 1),
            order.get(r["system"], len(order)),
        ),  # fmt: skip
    )

    def setting(r: dict) -> tuple:
        return r["model"], r["micro_batch"], r.get("grad_accum", 1)

    ddp = {setting(r): r.get("tokens_per_s_per_gpu") for r in records if r["system"] == "ddp"}
    for r in records:
        name = _SYSTEM_NAMES.get(r["system"], r["system"])
        if "error" in r:
            lines.append(f"| {r['model']} | | | {name} | {r['error'][:80]} | | | | | |")
            continue
        speed = r["tokens_per_s_per_gpu"]
        base = ddp.get(setting(r))
        ratio = f"{speed / base:.2f}x" if base else "-"
        peak = max(r["peak_allocated_per_rank"])
        planned_peak = r.get("planned_peak_bytes")
        # the planner models memfit's memory, not torch's
        planned = _gib(planned_peak) if planned_peak and r["system"].startswith("zero") else "-"
        step = r.get("planned_step_s")
        planned_step = f"{step:.3f} ({step / r['step_s'] - 1:+.0%})" if step else "-"
        accum = r.get("grad_accum", 1)
        batch = f"{r['micro_batch']}" + (f" x {accum} accumulated" if accum > 1 else "")
        lines.append(
            f"| {r['model']} | {batch} | {r['checkpointing']} | {name} | {speed:,.0f} "
            f"| {ratio} | {_gib(peak)} | {planned} | {r['step_s']:.3f} | {planned_step} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# scaling: every zero.py run at once, measured against the planner, carried to 4 and 8 GPUs

SCALING_GPUS = (1, 2, 4, 8)
SCALING_SYSTEMS = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2")


def scaling_points(runs: list[dict], models: tuple[str, ...]) -> dict:
    """(model, system, gpus) -> {"measured": the newest record with a step time, or None,
    "planned": (tokens/s per GPU, peak bytes per rank, fits) from the current planner, on the
    GPU the runs measured}. "planned" fills what was not measured (4 and 8 GPUs so far); a
    measured point is shown against the prediction its record holds (`recorded_tokens_per_s`)."""
    from memfit.models.config import load_model_config
    from memfit.planner import Strategy, get_gpu, plan, step_time

    newest: dict = {}
    shape: dict = {}
    gpu_name = "h200"
    for run in runs:
        if "H100" in run["env"].get("gpu", ""):
            continue  # one kind of GPU per table: the H200 runs
        for r in run["records"]:
            default = (
                r["model"] in models
                and r["micro_batch"] == _zero_benchmark().PRESETS[r["model"]][0]
            )
            if default and r["system"] in SCALING_SYSTEMS and r.get("grad_accum", 1) == 1:
                shape[r["model"]] = (r["micro_batch"], r["checkpointing"], r["seq_len"])
                if "step_s" in r:
                    newest[(r["model"], r["system"], r["gpus"])] = r
    points = {}
    for model_name, (micro_batch, checkpointing, seq_len) in shape.items():
        model = load_model_config(model_name)
        for system in SCALING_SYSTEMS:
            stage, _ = _zero_benchmark().zero_and_offload(system)
            for n in SCALING_GPUS:
                if stage and n == 1:
                    continue
                strategy = Strategy(
                    micro_batch=micro_batch, seq_len=seq_len, checkpointing=checkpointing,
                    zero=stage, world_size=n,
                )  # fmt: skip
                memory = plan(model, strategy, get_gpu(gpu_name))
                speed = step_time(model, strategy, get_gpu(gpu_name)).tokens_per_s
                points[(model_name, system, n)] = {
                    "measured": newest.get((model_name, system, n)),
                    "planned": (speed, memory.peak_bytes, memory.fits),
                }
    return points


def _zero_benchmark():
    """benchmarks/zero.py: its presets and systems."""
    import zero

    return zero


def recorded_tokens_per_s(record: dict) -> float | None:
    """Tokens/s per GPU that the time model predicted for a zero.py record when the run was made
    (its `planned_step_s`), or None where the record holds no prediction."""
    step = record.get("planned_step_s")
    if not step:
        return None
    return record["micro_batch"] * record["seq_len"] * record.get("grad_accum", 1) / step


def _efficiency(points: dict, model: str, system: str, n: int) -> str:
    """Tokens/s per GPU at n GPUs against 2: measured against measured, else planned against
    planned (never one against the other)."""
    two, at_n = points.get((model, system, 2)), points.get((model, system, n))
    if not (two and at_n):
        return "-"
    if two["measured"] and at_n["measured"]:
        return f"**{at_n['measured']['tokens_per_s_per_gpu'] / two['measured']['tokens_per_s_per_gpu']:.0%}**"
    if at_n["planned"][2] and two["planned"][2]:
        return f"*{at_n['planned'][0] / two['planned'][0]:.0%}*"
    return "-"


def scaling_table(run: dict) -> str:
    runs = run["all_runs"]
    models = ("llama-2-7b", "llama-2-13b")
    points = scaling_points(runs, models)
    dates = sorted({r["env"]["date"][:10] for r in runs if "H100" not in r["env"].get("gpu", "")})
    commits = [r["env"]["commit"] for r in runs if "H100" not in r["env"].get("gpu", "")]
    lines = [
        f"Tokens/s per GPU on H200s, seq 2048, micro-batch 2, full checkpointing. Measured: "
        f"**bold** (in brackets the time model's prediction recorded with the run, '-' where the "
        f"record has none; newest run of each setting, up to commit {commits[-1]}, "
        f"{dates[-1]}). Not measured: today's planner's figure in italics; \u2717: the planner "
        "puts it over the GPU's memory. Efficiency: tokens/s per GPU against 2 GPUs, "
        "measured against measured (bold) or planned against planned (italics). DDP's and "
        "FSDP2's speeds are planned as memfit's stage 0 and 3.",
        "",
        "| model | system | 1 GPU | 2 GPUs | 4 GPUs | 8 GPUs | efficiency 2\u21924\u21928 | "
        "peak per rank at 2 / 4 / 8 GPUs (GiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in models:
        for system in SCALING_SYSTEMS:
            cells, peaks = [], []
            for n in SCALING_GPUS:
                point = points.get((model, system, n))
                if point is None:
                    cells.append("")
                    continue
                speed, peak, fits = point["planned"]
                measured = point["measured"]
                if measured:
                    recorded = recorded_tokens_per_s(measured)
                    cells.append(
                        f"**{measured['tokens_per_s_per_gpu']:,.0f}** "
                        + (f"({recorded:,.0f})" if recorded else "(-)")
                    )
                elif fits:
                    cells.append(f"*{speed:,.0f}*")
                else:
                    cells.append("\u2717")
                if n > 1:
                    if measured:
                        peaks.append(f"**{_gib(max(measured['peak_allocated_per_rank']))}**")
                    elif system in PLANNED_AS:  # the planner models memfit's memory, not torch's
                        peaks.append("-")
                    else:
                        peaks.append(f"*{_gib(peak)}*" if fits else "\u2717")
            efficiency = " \u2192 ".join(_efficiency(points, model, system, n) for n in (4, 8))
            two = points.get((model, system, 2))
            efficiency = f"100% \u2192 {efficiency}" if two and two["planned"][2] else "-"
            name = _SYSTEM_NAMES.get(system, system)
            lines.append(
                f"| {model} | {name} | " + " | ".join(cells) + f" | {efficiency} | "
                + " / ".join(peaks) + " |"
            )  # fmt: skip
    return "\n".join(lines)


def scaling_plot(runs: list[dict], path: Path) -> Path | None:
    """Tokens/s per GPU against GPUs: measured points, the planner's lines."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no scaling plot")
        return None
    models = ("llama-2-7b", "llama-2-13b")
    points = scaling_points(runs, models)
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5))
    for ax, model in zip(axes, models, strict=True):
        for index, system in enumerate(SCALING_SYSTEMS):
            color = f"C{index}"
            planned = [
                (n, p["planned"][0]) for n in SCALING_GPUS
                if (p := points.get((model, system, n))) and p["planned"][2]
            ]  # fmt: skip
            measured = [
                (n, p["measured"]["tokens_per_s_per_gpu"]) for n in SCALING_GPUS
                if (p := points.get((model, system, n))) and p["measured"]
            ]  # fmt: skip
            label = _SYSTEM_NAMES.get(system, system).replace("**", "").split(" (")[0]
            if planned and system not in PLANNED_AS:
                ax.plot(*zip(*planned, strict=True), "--", color=color, alpha=0.6)
            if measured:
                ax.plot(*zip(*measured, strict=True), "o", color=color, label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(SCALING_GPUS, [str(n) for n in SCALING_GPUS])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.set_title(f"{model}, seq 2048, mb 2, full checkpointing")
        ax.set_xlabel("H200 GPUs")
        ax.set_ylabel("tokens/s per GPU")
        ax.legend(fontsize=8, loc="lower left")
    fig.suptitle("measured (points) and planned by memfit's time model (dashed)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _gpus(run: dict) -> int:
    """The number of GPUs of a zero.py run (0 for a run without records)."""
    return max((r.get("gpus", 0) for r in run.get("records", [])), default=0)


def _offload_run(run: dict) -> bool:
    """A zero.py run of offload on one GPU."""
    return _gpus(run) == 1 and any("offload" in r["system"] for r in run.get("records", []))


def inference_table(run: dict) -> str:
    """benchmarks/inference.py: the decode kernel, offline throughput and batch-1 decode."""
    copy = run["copy_tb_s"]
    lines = [
        _env_line(run, f"device-to-device copy {copy:.2f} TB/s.", transformers=True),
        "",
        "Decode attention, bf16, one query token per sequence, GQA 32/8, 16-token blocks; both "
        "kernels replayed from CUDA graphs; bytes = K and V read once:",
        "",
        "| batch | context | head dim | memfit | SDPA (contiguous) | memfit / SDPA | of copy |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in run.get("kernel", []):
        lines.append(
            f"| {k['batch']} | {k['context']} | {k['head_dim']} | {k['memfit_ms']:.3f} ms, "
            f"{k['memfit_tb_s']:.2f} TB/s ({k['splits']} splits) | {k['sdpa_ms']:.3f} ms, "
            f"{k['sdpa_tb_s']:.2f} TB/s | {k['memfit_over_sdpa']:.2f}x | "
            f"{k['memfit_of_copy']:.0%} |"
        )
    if "prefill" in run:
        lines += [
            "",
            "Prefill attention, one sequence, 2048 new tokens over a cached prefix, bf16, GQA 32/8, "
            "D=128, against memfit's FlashAttention over the same keys stored contiguously "
            "(TFLOP/s of the causal product):",
            "",
            "| prefix | memfit paged | contiguous FlashAttention | paged / contiguous |",
            "|---|---|---|---|",
        ]
        for p in run["prefill"]:
            lines.append(
                f"| {p['prefix']} | {p['memfit_ms']:.2f} ms, {p['memfit_tflops']:.0f} | "
                f"{p['flash_ms']:.2f} ms, {p['flash_tflops']:.0f} | "
                f"{p['memfit_tflops'] / p['flash_tflops']:.2f}x |"
            )
    if "throughput" in run:
        t = run["throughput"]
        m, hf = t["memfit"], t["hf"]
        lines += [
            "",
            f"Offline throughput, llama-3.2-1b shapes, random bf16 weights, {t['requests']} "
            f"requests, prompts of 64-512 tokens, {t['new_tokens']} new tokens each:",
            "",
            "| system | tokens/s | time | peak | steps | mean KV waste |",
            "|---|---|---|---|---|---|",
            f"| memfit `LLM.generate` | **{m['tokens_per_s']:,.0f}** ({t['speedup']:.1f}x) | "
            f"{m['seconds']:.2f} s | {m['peak_gib']:.1f} GiB | {m['steps']} | "
            f"{m['kv_waste_mean']:.2%} |",
            f"| transformers `generate_batch` | {hf['tokens_per_s']:,.0f} | {hf['seconds']:.2f} s "
            f"| {hf['peak_gib']:.1f} GiB | - | - |",
        ]
    if "batch1" in run:
        lines += [
            "",
            "Batch-1 decode, prompt 128, 256 new tokens; the limit: weights and KV read once per "
            "token at the copy bandwidth:",
            "",
            "| model | tokens/s | ms/token | limit | of limit | captured step alone |",
            "|---|---|---|---|---|---|",
        ]
        for b in run["batch1"]:
            lines.append(
                f"| {b['model']} | {b['tokens_per_s']:.1f} | {b['ms_per_token']:.3f} | "
                f"{b['limit_ms_per_token']:.3f} ms | {b['of_limit']:.1%} | "
                f"{b['graph_ms_per_token']:.3f} ms ({b['graph_of_limit']:.1%}) |"
            )
    return "\n".join(lines)


def serve_table(run: dict) -> str:
    """benchmarks/serve.py: memfit serve and transformers serve under the same load."""

    def ms(stats: dict, key: str) -> str:
        return f"{stats[key] * 1e3:.1f}" if key in stats else "-"

    def row(system: str, r: dict, extra: str = "") -> str:
        return (
            f"| {system} | {r['rate']}{extra} | {r['tokens_per_s']:,.0f} | "
            f"{ms(r['ttft'], 'p50')} / {ms(r['ttft'], 'p99')} | "
            f"{ms(r['itl'], 'p50')} / {ms(r['itl'], 'p99')} |"
        )

    low, high = run["prompt_tokens"]
    peer = run["peer"]
    lines = [
        _env_line(run, f"transformers serve from transformers {peer['transformers']}."),
        "",
        f"Streamed completions over localhost, llama-3.2-1b shapes, random bf16 weights, a "
        f"word-level tokenizer, {run['requests']} requests of {low}-{high} prompt tokens and "
        f"{run['new_tokens']} new tokens each (none stops early), Poisson arrivals at each rate "
        "(inf: all at once); the load from client processes of its own. TTFT and ITL in ms:",
        "",
        "| server | requests/s | output tokens/s | TTFT p50 / p99 | ITL p50 / p99 |",
        "|---|---|---|---|---|",
    ]
    lines += [row("`transformers serve --continuous-batching`", r) for r in peer["rates"]]
    lines += [row("`memfit serve`", r) for r in run.get("rates", [])]
    lines += [
        row(
            "`memfit serve"
            + (f" --api-servers {r['api_servers']}" if "api_servers" in r else "")
            + "`",
            r,
            f", prefill budget {r['max_step_tokens']}"
            + (f", max running {r['max_running']}" if "max_running" in r else ""),
        )
        for r in run.get("chunk", [])
    ]
    lines += [
        row("`memfit serve`", r, f", stream interval {r['stream_interval']}")
        for r in run.get("interval", [])
    ]
    lines += [
        row(f"`memfit serve --api-servers {r['api_servers']}`", r)
        for r in run.get("api_servers", [])
    ]
    in_process = run.get("in_process", {})
    if "engine_in_thread" in in_process:
        lines.append(row("`memfit serve --engine-in-thread`", in_process["engine_in_thread"]))
    offline = in_process.get("offline", run.get("offline"))  # (runs before the engine process)
    if offline is not None:
        lines.append(
            f"| memfit `LLM.generate` (offline, no HTTP) | all at once | "
            f"{offline['tokens_per_s']:,.0f} | - | - |"
        )
    lines += _saturation_lines(run.get("chunk", []))
    if "second_call" in run:
        later = run["second_call"]
        lines += [
            "",
            f"The parts {', '.join(later['parts'])} of `benchmarks/serve.py` ran in a second call "
            f"on the same machine kind, at commit {later['commit']}.",
        ]
    if "prefix" in run:
        off, on = (next(r for r in run["prefix"] if r["prefix_caching"] == c) for c in (0, 1))
        lines += [
            "",
            f"{off['requests']} requests behind one 1,024-token system prompt (and 64 tokens of "
            "their own), all at once:",
            "",
            "| prefix caching | peak KV blocks | mean TTFT | output tokens/s |",
            "|---|---|---|---|",
            f"| off | {off['peak_blocks']:,} | {off['ttft_mean_s'] * 1e3:.0f} ms | "
            f"{off['tokens_per_s']:,.0f} |",
            f"| on | {on['peak_blocks']:,} ({on['peak_blocks'] / off['peak_blocks']:.0%}) | "
            f"{on['ttft_mean_s'] * 1e3:.0f} ms ({off['ttft_mean_s'] / on['ttft_mean_s']:.2f}x "
            f"lower) | {on['tokens_per_s']:,.0f} |",
        ]
    if "n" in run:
        n = run["n"]
        lines += [
            "",
            f"Parallel sampling of one {n['prompt_tokens']:,}-token prompt, {n['new_tokens']} new "
            f"tokens: `n`=4 peaks at {n['n=4']} KV blocks, four separate requests of it at "
            f"{n['4 requests']} ({n['ratio']:.0%}).",
        ]
    return "\n".join(lines)


def lora_table(run: dict) -> str:
    """benchmarks/lora.py: LoRA training, memfit against transformers + peft; QLoRA against
    memfit's LoRA at the same micro-batch. The newest record of each (model, micro-batch,
    system) among the runs on the newest run's GPU that record the plan (a model or two per
    call: one table)."""
    gpu = run["env"].get("gpu")
    runs = [  # (runs that record the plan: the benchmark as it is now)
        r for r in run["all_runs"]
        if r["env"].get("gpu") == gpu and any("planned_peak_gib" in x for x in r["records"])
    ]  # fmt: skip
    records = _latest(
        [
            rec | {"micro_batch": rec.get("micro_batch", r["micro_batch"]),
                   "commit": r["env"]["commit"]}
            for r in runs for rec in r["records"]
        ],
        lambda r: (r["model"], r["micro_batch"], r["system"]),
    )  # fmt: skip
    peer = next((r for r in records if "peft" in r), {})
    commits = ", ".join(dict.fromkeys(r["commit"] for r in records))
    env = run["env"] | {"commit": commits}
    lines = [
        _env_line(
            run | {"env": env},
            f"transformers {peer.get('transformers', '-')}, peft {peer.get('peft', '-')}.",
        ),
        "",
        f"Random weights, the base frozen in bf16, rank {run['rank']} adapters (alpha "
        f"{2 * run['rank']}) on every linear layer in fp32, bf16 autocast, AdamW, activation "
        f"checkpointing (every block unless said), sequence {run['seq_len']}; planned: "
        "`memfit plan`'s peak for the same run:",
        "",
        "| model | micro-batch | system | tokens/s | peak | planned peak | trainable parameters |",
        "|---|---|---|---|---|---|---|",
    ]
    for model, batch in sorted(dict.fromkeys((r["model"], r["micro_batch"]) for r in records)):
        rows = {r["system"]: r for r in records if (r["model"], r["micro_batch"]) == (model, batch)}
        theirs, ours = rows.get("transformers+peft", {}), rows.get("memfit", {})
        for system, r in rows.items():
            if "error" in r:
                lines.append(f"| {model} | {batch} | {system} | {r['error'][:60]} | - | - | - |")
                continue
            speed, peak = f"{r['tokens_per_s']:,.0f}", f"{r['peak_gib']:.2f} GiB"
            if r.get("checkpoint_blocks"):
                system += f" ({r['checkpoint_blocks']} blocks checkpointed)"
            if system.startswith("memfit QLoRA"):
                if "tokens_per_s" in ours:
                    speed += f" ({r['tokens_per_s'] / ours['tokens_per_s']:.2f}x LoRA)"
            elif system.startswith("memfit") and "tokens_per_s" in theirs:
                speed = f"**{speed}** ({r['tokens_per_s'] / theirs['tokens_per_s']:.2f}x)"
                peak += f" ({r['peak_gib'] / theirs['peak_gib'] - 1:+.0%})"
            planned = "-"
            if "planned_peak_gib" in r:
                error = r["planned_peak_gib"] / r["peak_gib"] - 1
                planned = f"{r['planned_peak_gib']:.2f} GiB ({error:+.1%})"
            lines.append(
                f"| {model} | {batch} | {system} | {speed} | {peak} | {planned} | "
                f"{r['trainable_params'] / 1e6:.1f}M |"
            )
    return "\n".join(lines)


def distill_table(run: dict) -> str:
    """benchmarks/distill.py: the distillation loss, forward + backward, against the unfused
    loss a user writes."""
    lines = [
        _env_line(run, "median of CUDA-event times after warm-up."),
        "",
        f"Student hidden {run['student_hidden']}, teacher hidden {run['teacher_hidden']}, "
        f"vocabulary {run['vocab']:,}, bf16 autocast, KL at temperature 2, alpha 0.5; extra: "
        "the peak the loss adds over its inputs and weights:",
        "",
        "| tokens | system | forward + backward | extra memory |",
        "|---|---|---|---|",
    ]
    records = _latest(run["records"], lambda r: (r["tokens"], r["system"]))
    for r in records:
        if "error" in r:
            lines.append(f"| {r['tokens']:,} | {r['system']} | {r['error'][:60]} | - |")
            continue
        base = next(
            (x for x in records if x["tokens"] == r["tokens"] and x["system"] == "unfused"), {}
        )
        ok = r is not base and "ms" in base
        versus = f" ({r['ms'] / base['ms']:.2f}x)" if ok else ""
        extra = f" ({r['extra_gib'] / base['extra_gib']:.2f}x)" if ok else ""
        lines.append(
            f"| {r['tokens']:,} | {r['system']} | {r['ms']:.1f} ms{versus} | "
            f"{r['extra_gib']:.2f} GiB{extra} |"
        )
    return "\n".join(lines)


def _sparse_rows(run: dict) -> dict[tuple, dict]:
    return {(r["seqlen"], r["pattern"], r["system"]): r for r in run["records"]}


def sparse_attention_table(run: dict) -> str:
    """benchmarks/sparse_attention.py: memfit's sparse attention against torch.compile(Flex)
    with the same masks, and against memfit's dense causal FlashAttention."""
    rows = _sparse_rows(run)
    graphs = any("forward_backward_graph_ms" in r for r in rows.values())
    lines = [
        _env_line(run, "median of CUDA-event times after warm-up."),
        "",
        f"Batch 1, {run['heads']} heads, head dim {run['head_dim']}, bf16; forward + backward "
        "(forward alone), ms"
        + (
            "; CUDA graph: ten forward + backward calls captured in one graph and replayed, ms "
            "a call, memfit / Flex"
            if graphs
            else ""
        )
        + ":",
        "",
        "| N | pattern | memfit | Flex | memfit vs Flex | memfit vs dense causal |"
        + (" CUDA graph | memfit vs Flex, CUDA graph |" if graphs else ""),
        "|---|---|---|---|---|---|" + ("---|---|" if graphs else ""),
    ]

    def graph(r: dict | None, flex: dict | None) -> str:
        if not graphs:
            return ""
        ours, theirs = (x.get("forward_backward_graph_ms") if x else None for x in (r, flex))
        if ours is None:
            return " - | - |"
        if theirs is None:
            return f" {ours:.2f} / - | - |"
        return f" {ours:.2f} / {theirs:.2f} | {theirs / ours:.2f}x |"

    def ms(r: dict | None) -> str:
        if r is None:
            return "-"
        if "error" in r:
            return r["error"].split(":")[0]
        return f"{r['forward_backward_ms']:.2f} ({r['forward_ms']:.2f})"

    for n in sorted({key[0] for key in rows}):
        dense = rows.get((n, "dense causal", "memfit flash"))
        for pattern in dict.fromkeys(key[1] for key in rows if key[0] == n):
            if pattern == "dense causal":
                continue
            flex = rows.get((n, pattern, "flex"))
            for system in ("memfit", "memfit block-sparse kernels"):
                r = rows.get((n, pattern, system))
                if r is None or "error" in r:
                    continue
                name = pattern if system == "memfit" else f"{pattern} (block-sparse kernels)"
                versus = "-"
                if flex and "error" not in flex:
                    versus = f"{flex['forward_backward_ms'] / r['forward_backward_ms']:.2f}x"
                to_dense = "-"
                if dense and "error" not in dense:
                    to_dense = f"{r['forward_backward_ms'] / dense['forward_backward_ms']:.2f}x"
                lines.append(
                    f"| {n // 1024}k | {name} | {ms(r)} | {ms(flex if system == 'memfit' else None)}"
                    f" | {versus if system == 'memfit' else '-'} | {to_dense} |"
                    + graph(r, flex if system == "memfit" else None)
                )
        if dense:
            lines.append(
                f"| {n // 1024}k | dense causal (memfit flash) | {ms(dense)} | - | - | 1x |"
                + graph(dense, None)
            )
    return "\n".join(lines)


def sparse_scaling_table(run: dict) -> str:
    """benchmarks/sparse_attention.py --systems memfit over N: time and extra memory."""
    rows = _sparse_rows(run)
    lengths = sorted({key[0] for key in rows})
    lines = [
        _env_line(run, "median of CUDA-event times after warm-up."),
        "",
        "Forward + backward in ms / the memory it adds in MiB, batch 1, "
        f"{run['heads']} heads, head dim {run['head_dim']}, bf16:",
        "",
        "| pattern | " + " | ".join(f"{n // 1024}k" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for pattern, system in dict.fromkeys((key[1], key[2]) for key in rows):
        cells = []
        for n in lengths:
            r = rows.get((n, pattern, system))
            ok = r is not None and "error" not in r
            cells.append(f"{r['forward_backward_ms']:.2f} / {r['extra_mib']:,.0f}" if ok else "-")
        lines.append(f"| {pattern} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sparse_train_table(run: dict) -> str:
    """benchmarks/sparse_attention.py --train: llama-1b training with a pattern on every layer
    against dense memfit flash."""
    records = _latest(run["records"], lambda r: r["pattern"])
    lines = [
        _env_line(run, "median step after warm-up."),
        "",
        f"llama-1b shapes, random weights, sequence {records[0]['seqlen']:,}, micro-batch 1, "
        "bf16, full checkpointing:",
        "",
        "| attention | pattern | tokens/s | peak |",
        "|---|---|---|---|",
    ]
    dense = next((r for r in records if r["pattern"] == "dense"), {})
    for r in records:
        if "error" in r:
            lines.append(f"| {r['pattern']} | `{r['spec']}` | {r['error'][:60]} | - |")
            continue
        speed = f"{r['tokens_per_s']:,.0f}"
        if r is not dense and "tokens_per_s" in dense:
            speed += f" ({r['tokens_per_s'] / dense['tokens_per_s']:.2f}x)"
        spec = f"`{r['spec']}`" if r["spec"] else "dense causal (memfit flash)"
        lines.append(f"| {r['pattern']} | {spec} | {speed} | {r['peak_gib']:.2f} GiB |")
    return "\n".join(lines)


def sparse_decode_table(run: dict) -> str:
    """benchmarks/sparse_attention.py --decode: one paged decode step over the context."""
    records = _latest(run["records"], lambda r: (r["seqlen"], r["pattern"]))
    lengths = sorted({r["seqlen"] for r in records})
    lines = [
        _env_line(run, "median of CUDA-graph replays after warm-up."),
        "",
        f"One decode step of the paged kernels, {records[0]['batch']} sequences, 32 query heads "
        "and 8 kv heads of 128 (llama-3-8b's), bf16, 16-token pages; microseconds:",
        "",
        "| pattern | " + " | ".join(f"{n // 1024}k" for n in lengths) + " |",
        "|---|" + "---|" * len(lengths),
    ]
    for pattern in dict.fromkeys(r["pattern"] for r in records):
        cells = [
            next(
                (f"{r['us']:.1f}" for r in records if (r["seqlen"], r["pattern"]) == (n, pattern)),
                "-",
            )
            for n in lengths
        ]
        lines.append(f"| {pattern} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def quant_decode_table(run: dict) -> str:
    """benchmarks/quant_decode.py: quantized GEMV kernels and batch-1 decode against bf16; on
    each GPU, each model's batch-1 rows from the newest run that has them (a run may measure one
    model) and the newest kernel times, each run that gives rows with its own header."""
    newest_for: dict[tuple[str, str], int] = {}
    kernels: dict[str, int] = {}  # the newest run with kernel times on each GPU
    runs = run.get("all_runs", [run])
    for index, r in enumerate(runs):
        gpu = r["env"].get("gpu", "")
        for row in r.get("batch1", []):
            newest_for[(gpu, row["model"])] = index
        if r.get("kernels"):
            kernels[gpu] = index
    parts = []
    for index in sorted(set(newest_for.values()) | set(kernels.values())):
        r = runs[index]
        gpu = r["env"].get("gpu", "")
        models = {m for (g, m), i in newest_for.items() if i == index and g == gpu}
        rows = [row for row in r.get("batch1", []) if row["model"] in models]
        parts.append(
            _quant_decode_run(
                {
                    **r,
                    "batch1": rows,
                    "kernels": r.get("kernels") if kernels.get(gpu) == index else None,
                }
            )
        )
    return "\n\n".join(parts)


def _quant_decode_run(run: dict) -> str:
    lines = [
        _env_line(run, f"device-to-device copy {run['copy_tb_s']:.2f} TB/s."),
        "",
        f"Kernel launch configurations (int8 / int4): {run['config']['int8']} / "
        f"{run['config']['int4']}"
        + (
            f", int4 in packed halves {run['config']['int4_half']} (rows a program, features a "
            "tile, warps, stages)."
            if "int4_half" in run["config"]
            else "."
        ),
        "",
    ]
    if run.get("kernels"):
        lines += [
            "One token times each linear layer of a block, replayed from a CUDA graph with cold "
            "weights; microseconds (bandwidth reading the weight's bytes):",
            "",
            "| model | layer | N x K | cuBLAS bf16 | memfit bf16 | memfit int8 | memfit int4 |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in run["kernels"]:
            cells = [
                f"{r[f'{name}_us']:.1f} ({r[f'{name}_tb_s']:.2f} TB/s)"
                for name in ("cublas", "memfit_bf16", "int8", "int4")
            ]
            lines.append(
                f"| {r['model']} | {r['layer']} | {r['n']} x {r['k']} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    if run.get("batch1"):
        heads = (
            "the embedding in bf16, the output head in int8 under int8 and int4 weights"
            if any(r.get("head") == "int8" for r in run["batch1"])
            else "the embedding and output head in bf16"
        )
        lines += [
            f"Batch-1 decode, one prompt of 128 tokens, 256 new tokens (random weights; {heads}):",
            "",
            "| model | weights | model (GiB) | tokens/s | ms/token | bandwidth limit (ms) | "
            "of limit | vs bf16 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in run["batch1"]:
            lines.append(
                f"| {r['model']} | {r['weights']} | {r['model_bytes'] / 2**30:.2f} | "
                f"{r['tokens_per_s']:.1f} | {r['ms_per_token']:.3f} | "
                f"{r['limit_ms_per_token']:.3f} | {r['of_limit']:.0%} | "
                f"{r['speedup_vs_bf16']:.2f}x |"
            )
    return "\n".join(lines).rstrip()


def kv_fp8_table(run: dict) -> str:
    """benchmarks/inference.py --parts kv_fp8: the 256-request workload at a fixed KV pool with
    a bf16, an fp8 and (runs from int8's commit on) an int8 cache, and the decode kernel over
    each."""
    kv = run["kv_fp8"]
    kinds = ("fp8", "int8") if "int8" in kv else ("fp8",)
    lines = [
        _env_line(run, "the engine's steps with CUDA graphs."),
        "",
        f"{kv['requests']} requests of {kv['new_tokens']} new tokens each (prompts of 64-512 "
        f"tokens, seeded), {kv['model']} shapes with random weights, the KV pool fixed at "
        f"{kv['kv_budget_gib']:g} GiB for each:",
        "",
        "| KV cache | pool (tokens) | tokens/s | steps | preemptions | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("bf16", *kinds):
        r = kv[name]
        lines.append(
            f"| {name} | {r['kv_tokens']:,} | {r['tokens_per_s']:,.0f} | {r['steps']:,} | "
            f"{r['preemptions']} | {r['peak_gib']:.2f} |"
        )
    ratios = {"fp8": kv["kv_tokens_ratio"], "int8": kv.get("int8_kv_tokens_ratio")}
    lines += [""] + [
        f"{kind} against bf16: {ratios[kind]:.2f}x the tokens, "
        f"{kv[kind + '_over_bf16']:.2f}x the tokens/s." for kind in kinds
    ]  # fmt: skip
    lines += [
        "",
        "The decode kernel alone (GQA 32/8, head dim 128, 16-token pages, CUDA-graph replays), "
        "ms (bytes of K and V read per second, int8's scales included):",
        "",
        "| batch | context | bf16 pools | " + " | ".join(f"{k} pools | {k} vs bf16" for k in kinds)
        + " |",
        "|---|---|---|" + "---|---|" * len(kinds),
    ]  # fmt: skip
    for r in kv["kernel"]:
        cells = [f"{r['batch']}", f"{r['context']:,}",
                 f"{r['bf16_ms']:.3f} ({r['bf16_tb_s']:.2f} TB/s)"]  # fmt: skip
        for kind in kinds:
            cells += [f"{r[kind + '_ms']:.3f} ({r[kind + '_tb_s']:.2f} TB/s)",
                      f"{r[kind + '_speedup']:.2f}x"]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _with_flex(run: dict) -> bool:
    return any(r["system"] == "flex" for r in run.get("records", []))


def _saturation_lines(rows: list[dict]) -> list[str]:
    """For each server of the chunk part measured unloaded and at several Poisson rates: the
    rate where its throughput saturates (the lowest whose tokens/s come within 3% of the most
    any rate reached) and its p99 ITL there against the unloaded ITL (the issue's bar: 3x)."""
    lines = []
    servers: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["max_step_tokens"], r.get("max_running"), r.get("api_servers", 1))
        servers.setdefault(key, []).append(r)
    for (budget, running, http), loads in servers.items():
        unloaded = next((r for r in loads if r["rate"] == "one at a time"), None)
        rated = [r for r in loads if isinstance(r["rate"], (int, float))]
        if unloaded is None or len(rated) < 2:
            continue
        most = max(r["tokens_per_s"] for r in loads if r is not unloaded)
        knee = min(
            (r for r in rated if r["tokens_per_s"] >= 0.97 * most),
            key=lambda r: r["rate"],
            default=None,
        )
        if knee is None:
            continue
        p99, base = knee["itl"]["p99"], unloaded["itl"]
        lines += [
            "",
            f"With `--max-step-tokens {budget}`"
            + (f" `--max-running {running}`" if running else "")
            + (f" `--api-servers {http}`" if http > 1 else "")
            + f", the throughput saturates at {knee['rate']:g} requests/s ({knee['tokens_per_s']:,.0f} "
            f"tokens/s, within 3% of the most at any rate, {most:,.0f}); the p99 ITL there is "
            f"{p99 * 1e3:.2f} ms: {p99 / base['p50']:.2f}x the unloaded p50 ({base['p50'] * 1e3:.2f} "
            f"ms) and {p99 / base['p99']:.2f}x the unloaded p99 ({base['p99'] * 1e3:.2f} ms).",
        ]
    return lines


def _time_model_records(run: dict, part: str) -> list[dict]:
    """The records of `part` in every run, each with its run's start (UTC): each run had a
    machine of its own."""
    return [
        {**r, "started": x["env"]["date"][11:16], "gpu": x["env"].get("gpu", "")}
        for x in run.get("all_runs", [run])
        for r in x["records"]
        if r.get("part") == part
    ]


def _part_run(run: dict, part: str) -> dict:
    """`run` with the env of the newest run holding `part`, naming every commit that did."""
    holding = [
        x for x in run.get("all_runs", [run]) if any(r.get("part") == part for r in x["records"])
    ]
    commits = list(dict.fromkeys(x["env"]["commit"] for x in holding))
    return {
        **run,
        "env": {**holding[-1]["env"], "commit": " to ".join(commits[:: max(1, len(commits) - 1)])},
    }


def _model_and_strategy(record: dict):
    """A time_model.json record's model and Strategy (benchmarks/fit_time_model.py's reading)."""
    import tempfile

    from fit_time_model import model_of, strategy_of

    with tempfile.TemporaryDirectory() as tmp:
        return model_of(record, Path(tmp)), strategy_of(record)


def _today(record: dict):
    """Today's time model's StepTime for a time_model.json record, on its GPU."""
    from memfit.planner import GPUS, step_time

    gpu = GPUS["h200" if "H200" in record.get("gpu", "") else "h100-sxm"]
    return step_time(*_model_and_strategy(record), gpu)


def _host_sets_pace(record: dict) -> bool:
    """memfit.planner.time.host_sets_pace for a time_model.json record, on its GPU."""
    from memfit.planner import GPUS
    from memfit.planner.time import host_sets_pace

    gpu = GPUS["h200" if "H200" in record.get("gpu", "") else "h100-sxm"]
    return host_sets_pace(*_model_and_strategy(record), gpu)


def _time_strategy(r: dict) -> str:
    s = r["strategy"]
    text = f"seq {r['seq_len']}, mb {r['micro_batch']}"
    if r["grad_accum"] > 1:
        text += f" x {r['grad_accum']}"
    text += f", {s['checkpointing']}"
    if s["checkpoint_blocks"] is not None:
        text += f" ({s['checkpoint_blocks']} blocks)"
    if r["precision"] != "bf16":
        text += f", {r['precision']}"
    if s["optimizer"] != "adamw":
        text += f", {s['optimizer']}" + (", bf16 weights" if s["master_weights"] == "none" else "")
    if s["offload"] != "none":
        text += f", offload {s['offload']}"
    return text


def time_model_table(run: dict) -> str:
    """benchmarks/time_model.py's held-out part: Hugging Face models the time model is not
    fitted to, each step against today's time model and the one of the run."""
    run = _part_run(run, "held_out")
    lines = [
        _env_line(run, "eager blocks, random weights, median of 5 steps after 3.")
        + " Each run on a machine of its own (the one H100 each lent; those started at 19:48"
        " and 19:50 shared one: the allocator's default, then expandable segments), its start"
        " in UTC."
        " Predicted: today's time model (fitted to the designed set, not to these) and, in"
        " brackets, the one the run had.",
        "",
        "| model | params | strategy | run (UTC) | measured (ms) | predicted (ms) | error | the host sets the pace | predicted when run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in _time_model_records(run, "held_out"):
        if "step_s" not in r:
            continue
        today = _today(r)
        lines.append(
            f"| {r['model']} | {r['params'] / 1e9:.2f}B | {_time_strategy(r)} | {r['started']} | "
            f"{r['step_s'] * 1e3:.1f} | {today.total_s * 1e3:.1f} | "
            f"{today.total_s / r['step_s'] - 1:+.1%} | {'yes' if _host_sets_pace(r) else 'no'} | "
            f"{r['predicted_step_s'] * 1e3:.1f} ({r['time_error']:+.1%}) |"
        )
    return "\n".join(lines)


def graphs_table(run: dict, part: str = "graphs") -> str:
    """benchmarks/time_model.py --parts graphs (or held_out_graphs): each configuration's eager
    step and its step captured in a CUDA graph (`--cuda-graphs`), one after the other on one
    machine, against today's time model."""
    run = _part_run(run, part)
    lines = [
        _env_line(
            run, "random weights, median of 5 steps after 3; the eager step, then the captured one."
        )
        + " Predicted: today's time model (the run's GPU's constants); captured: - where the"
        " engine refuses to capture the step (the reason in time_model.json).",
        "",
        "| model | strategy | eager (ms) | captured (ms) | speed-up | eager predicted | captured predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    records = _time_model_records(run, part)
    captured = {
        (r["model"], r["seq_len"], r["micro_batch"], r["checkpointing"]): r
        for r in records
        if r["settings"].get("cuda_graphs")
    }
    for r in records:
        graphed = captured.get((r["model"], r["seq_len"], r["micro_batch"], r["checkpointing"]))
        if r["settings"].get("cuda_graphs") or "step_s" not in r or graphed is None:
            continue
        eager = _today(r).total_s
        row = f"| {r['model']} | {_time_strategy(r)} | {r['step_s'] * 1e3:.1f} | "
        if "step_s" in graphed:
            today = _today(graphed).total_s
            row += (
                f"{graphed['step_s'] * 1e3:.1f} | {r['step_s'] / graphed['step_s']:.2f}x | "
                f"{eager * 1e3:.1f} ({eager / r['step_s'] - 1:+.1%}) | "
                f"{today * 1e3:.1f} ({today / graphed['step_s'] - 1:+.1%}) |"
            )
        else:
            row += f"- | - | {eager * 1e3:.1f} ({eager / r['step_s'] - 1:+.1%}) | - |"
        lines.append(row)
    return "\n".join(lines)


def graph_floor_table(run: dict) -> str:
    """benchmarks/time_model.py --parts graph_floor graph_floor_held_out: short steps captured in
    a CUDA graph, where each kernel's least time shows, against today's time model (fitted to
    the designed shapes, not to the Hugging Face models) and the one of the run."""
    run = _part_run(run, "graph_floor")
    lines = [
        _env_line(run, "random weights, captured steps (`--cuda-graphs`), median of 5 after 3.")
        + " Kernels: one step's, counted with torch.profiler. Predicted: today's time model and,"
        " in brackets, the one the run had (no least time a kernel, products at their full rate).",
        "",
        "| model | fitted | strategy | kernels | measured (ms) | predicted (ms) | error | predicted when run |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for part in ("graph_floor", "graph_floor_held_out"):
        for r in _time_model_records(run, part):
            if "step_s" not in r:
                continue
            today = _today(r).total_s
            lines.append(
                f"| {r['model']} | {'yes' if part == 'graph_floor' else 'no'} | "
                f"{_time_strategy(r)} | {r.get('kernels') or '-'} | {r['step_s'] * 1e3:.1f} | "
                f"{today * 1e3:.1f} | {today / r['step_s'] - 1:+.1%} | "
                f"{r['predicted_step_s'] * 1e3:.1f} ({r['time_error']:+.1%}) |"
            )
    return "\n".join(lines)


def recommend_table(run: dict) -> str:
    """benchmarks/time_model.py --parts recommend: each model's first three strategies, run."""
    run = _part_run(run, "recommend")
    lines = [
        _env_line(run, "2^16 tokens a step, seq 2048, eager blocks, the median of 2 steps after 1.")
        + " Place: where `memfit plan --recommend` (and `--auto`) ranked it; predicted: today's"
        " time model.",
        "",
        "| model | place | strategy | measured tokens/s | vs the fastest measured | predicted tokens/s (error) | peak GiB (predicted) |",
        "|---|---|---|---|---|---|---|",
    ]
    records = [r for r in _time_model_records(run, "recommend") if "step_s" in r]
    for r in records:
        fastest = max(x["tokens_per_s"] for x in records if x["model"] == r["model"])
        today = _today(r)
        tokens = r["micro_batch"] * r["seq_len"] * r["grad_accum"]
        lines.append(
            f"| {r['model']} | {r['place']} | {_time_strategy(r)} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / fastest - 1:+.1%} | {tokens / today.total_s:,.0f} "
            f"({r['step_s'] / today.total_s - 1:+.1%}) | {r['peak_bytes'] / 2**30:.1f} "
            f"({r['predicted_peak_bytes'] / 2**30:.1f}) |"
        )
    return "\n".join(lines)


def adaptive_table(run: dict) -> str:
    """benchmarks/time_model.py --parts adaptive: --checkpointing auto against every block."""
    run = _part_run(run, "adaptive")
    lines = [
        _env_line(run, "eager blocks, random weights, median of 5 steps after 3.")
        + " Without checkpointing neither fits the GPU. The runs started at 19:48 and 19:50"
        " shared a machine (the allocator's default, then expandable segments).",
        "",
        "| model | seq x micro-batch | run (UTC) | checkpointing | what it ran | tokens/s | vs full | peak GiB (predicted) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    records = _time_model_records(run, "adaptive")
    for r in records:
        s = r.get("strategy") or {}
        what = s.get("checkpointing", "-")
        if what in ("full", "selective"):
            blocks = s["checkpoint_blocks"]
            what += f", first {blocks} blocks" if blocks is not None else ", every block"
        if "step_s" not in r:
            lines.append(
                f"| {r['model']} | {r['seq_len']} x {r['micro_batch']} | {r['started']} | "
                f"{r['checkpointing']} | {what} | {r['error'][:40]} | - | - |"
            )
            continue
        full = next(
            x for x in records
            if x["model"] == r["model"] and x["checkpointing"] == "full" and "step_s" in x
            and x["started"] == r["started"]
        )  # fmt: skip
        lines.append(
            f"| {r['model']} | {r['seq_len']} x {r['micro_batch']} | {r['started']} | "
            f"{r['checkpointing']} | {what} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / full['tokens_per_s']:.2f}x | "
            f"{r['peak_bytes'] / 2**30:.1f} ({r['predicted_peak_bytes'] / 2**30:.1f}) |"
        )
    return "\n".join(lines)


def fp32_parts_table(run: dict) -> str:
    """benchmarks/time_model.py --parts fp32_parts: what --fp32-parts costs, and the plan."""
    from memfit.planner import GPUS, plan, step_time

    run = _part_run(run, "fp32_parts")
    lines = [
        _env_line(run, "eager blocks, random weights, median of 5 steps after 3; sequences of "
                  "2048 tokens, micro-batch 4."),
        "",
        "| model | checkpointing | precision | fp32 parts | their products | tokens/s | vs none | step ms (planned) | peak GiB (planned) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    records = [r for r in _time_model_records(run, "fp32_parts") if "step_s" in r]
    records = [r for r in records if r["started"] == max(x["started"] for x in records)]
    for r in records:
        s = r["strategy"]
        base = next(
            x for x in records
            if x["model"] == r["model"] and x["checkpointing"] == r["checkpointing"]
            and x["precision"] == r["precision"] and not x["strategy"]["fp32_parts"]
        )  # fmt: skip
        model, strategy = _model_and_strategy(r)
        today = step_time(model, strategy, GPUS["h100-sxm"])
        planned = plan(model, strategy, GPUS["h100-sxm"])
        lines.append(
            f"| {r['model']} | {r['checkpointing']} | {r['precision']} | {s['fp32_parts'] or '-'} | "
            f"{s['fp32_matmul'] if s['fp32_parts'] else '-'} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x | {r['step_s'] * 1e3:.0f} "
            f"({today.total_s * 1e3:.0f}, {today.total_s / r['step_s'] - 1:+.0%}) | "
            f"{r['peak_bytes'] / 2**30:.2f} ({planned.peak_bytes / 2**30:.2f}) |"
        )
    return "\n".join(lines)


def capacity_table(run: dict) -> str:
    """benchmarks/time_model.py --parts capacity: runs planned at the GPU's capacity under each
    allocator, and what the plan says of them with that allocator's slack."""
    from memfit.planner.memory import ALLOCATOR_SLACK, CUDA_CONTEXT_BYTES

    run = _part_run(run, "capacity")
    lines = [
        _env_line(run, "eager blocks, random weights, the second step of each (the first makes "
                  "the optimizer's states). Planned for the memory the GPU reports (79.18 GiB)."),
        "",
        "| allocator | model | seq x micro-batch | checkpointing | planned peak GiB | plan says (slack) | ran | allocated peak GiB | reserved peak GiB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for x in run.get("all_runs", [run]):
        conf = x["env"].get("alloc_conf", "")
        mode = "expandable_segments" if conf.endswith("True") else "default"
        for r in x["records"]:
            if r.get("part") != "capacity":
                continue
            slack = ALLOCATOR_SLACK[mode]
            planned = r["predicted_peak_bytes"]
            fits = planned * (1 + slack) + CUDA_CONTEXT_BYTES <= x["gpu_capacity_bytes"]
            ran = "step_s" in r
            lines.append(
                f"| {mode.replace('_', ' ')} | {r['model']} | {r['seq_len']} x {r['micro_batch']} | "
                f"{r['checkpointing']} | {planned / 2**30:.2f} ({planned / x['gpu_capacity_bytes']:.1%}) | "
                f"{'fits' if fits else 'does not fit'} ({slack:.0%}) | "
                f"{'yes' if ran else 'out of memory'} | "
                + (f"{r['peak_bytes'] / 2**30:.2f} | {r['peak_reserved_bytes'] / 2**30:.2f} "
                   f"({r['peak_reserved_bytes'] / r['peak_bytes'] - 1:+.1%}) |" if ran else "- | - |")
            )  # fmt: skip
    return "\n".join(lines)


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
    "zero_offload": ("zero", partial(zero_table, offload=True), _offload_run, True),
    "scaling": ("zero", scaling_table, lambda run: _gpus(run) > 0, True),
    "inference": ("inference", inference_table, _has("kernel"), True),
    "serve": ("serve", serve_table, _has("peer"), True),
    "lora": ("lora", lora_table, _has("records"), True),
    "distill": ("distill", distill_table, _has("records"), True),
    "sparse_attention": ("sparse_attention", sparse_attention_table, _with_flex, True),
    "sparse_scaling": (
        "sparse_attention",
        sparse_scaling_table,
        lambda run: not _with_flex(run) and len({r["seqlen"] for r in run["records"]}) > 2,
        True,
    ),
    "sparse_train": ("sparse_attention_train", sparse_train_table, _has("records"), True),
    "sparse_decode": ("sparse_decode", sparse_decode_table, _has("records"), True),
    "quant_decode": ("quant_decode", quant_decode_table, _has("batch1"), True),
    "kv_fp8": ("inference", kv_fp8_table, _has("kv_fp8"), True),
    "time_model": ("time_model", time_model_table, _has("records"), True),
    "recommend": ("time_model", recommend_table, _has("records"), True),
    "adaptive_checkpointing": ("time_model", adaptive_table, _has("records"), True),
    "fp32_parts": ("time_model", fp32_parts_table, _has("records"), True),
    "allocator_capacity": ("time_model", capacity_table, _has("records"), True),
    "cuda_graphs": ("time_model", graphs_table, _has("records"), True),
    "held_out_graphs": (
        "time_model",
        lambda run: graphs_table(run, "held_out_graphs"),
        _has("records"),
        True,
    ),
    "graph_floor": ("time_model", graph_floor_table, _has("records"), True),
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
        table = render({**newest(runs), "all_runs": runs})
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
    zero_runs = args.results / "zero.json"
    if zero_runs.exists():
        runs = [run for run in json.loads(zero_runs.read_text()) if _gpus(run) > 0]
        if plot := scaling_plot(runs, args.results / "scaling.png"):
            print(f"wrote {plot}")
    args.doc.write_text(text)
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
