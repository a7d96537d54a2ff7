"""Refit the time model's constants (memfit.planner.time) to the designed measurements of
benchmarks/time_model.py, and score it on the runs it is not fitted on.

The constants are set on the module and memfit.planner.time.step_time itself predicts each
record, so what is fitted is exactly what the planner runs. Least squares on log(predicted /
measured), in two stages (STAGES): every step's constants over the designed set and the
host-bound steps of results/time_model.json (parts fit and host, H100), then, those kept, the
constants only short captured steps show (each kernel's least time, the products' rate at few
rows, a captured step's host) over part graph_floor (H200). The other parts (held_out: Hugging
Face models; graph_floor_held_out; adaptive; recommend; ...) are only scored. Prints the
constants to write into memfit/planner/time.py and each record's error.

    python benchmarks/fit_time_model.py            # fit, print constants and errors
    python benchmarks/fit_time_model.py --score    # score the constants time.py has now
    python benchmarks/fit_time_model.py --only KERNEL_SECONDS ...   # those alone
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
from pathlib import Path

from memfit.models.config import from_hf_config, load_model_config
from memfit.planner import GPUS, Strategy
from memfit.planner import time as time_model

RESULTS = Path(__file__).resolve().parent / "results" / "time_model.json"

# name -> (getter, setter) of each fitted constant
CONSTANTS = {
    "PEAK_EFFICIENCY": "PEAK_EFFICIENCY",
    "HALF_EFFICIENCY_WIDTH": "HALF_EFFICIENCY_WIDTH",
    "ATTENTION_EFFICIENCY[64]": ("ATTENTION_EFFICIENCY", 64),
    "ATTENTION_EFFICIENCY[128]": ("ATTENTION_EFFICIENCY", 128),
    "ELEMENTWISE_BYTES": "ELEMENTWISE_BYTES",
    "LOSS_BYTES_PER_LOGIT": "LOSS_BYTES_PER_LOGIT",
    "FP32_SLOWDOWN": "FP32_SLOWDOWN",
    "HOST_SECONDS_PER_BLOCK[none]": ("HOST_SECONDS_PER_BLOCK", "none"),
    "HOST_SECONDS_PER_BLOCK[full]": ("HOST_SECONDS_PER_BLOCK", "full"),
    "HOST_SECONDS_PER_BLOCK[selective]": ("HOST_SECONDS_PER_BLOCK", "selective"),
    "HOST_SECONDS_PER_STEP": "HOST_SECONDS_PER_STEP",
    "GRAPHED_HOST_SECONDS_PER_STEP": "GRAPHED_HOST_SECONDS_PER_STEP",
    "KERNEL_SECONDS": "KERNEL_SECONDS",
    "PRODUCT_ROWS": "PRODUCT_ROWS",
}
# the range each may take (fractions of a peak rate at most 1, counts and seconds positive)
BOUNDS = {
    "PEAK_EFFICIENCY": (0.1, 1.0),
    "HALF_EFFICIENCY_WIDTH": (0.0, 5000.0),
    "ATTENTION_EFFICIENCY[64]": (0.05, 1.0),
    "ATTENTION_EFFICIENCY[128]": (0.05, 1.0),
    "FP32_SLOWDOWN": (1.0, 100.0),
}
FITTED_PARTS = ("fit", "host", "graph_floor")
# the fit in two stages: the constants of every step on the H100's designed set and host-bound
# steps, then those only short captured steps show on the H200's captured ones, the first kept
STAGES = [
    ([name for name in CONSTANTS if name not in ("GRAPHED_HOST_SECONDS_PER_STEP", "KERNEL_SECONDS", "PRODUCT_ROWS")], ("fit", "host")),
    (["GRAPHED_HOST_SECONDS_PER_STEP", "KERNEL_SECONDS", "PRODUCT_ROWS"], ("graph_floor",)),
]  # fmt: skip


def get_constant(where) -> float:
    if isinstance(where, str):
        return getattr(time_model, where)
    table, key = where
    return getattr(time_model, table)[key]


def set_constant(where, value: float) -> None:
    if isinstance(where, str):
        setattr(time_model, where, value)
    else:
        table, key = where
        getattr(time_model, table)[key] = value


def load_records(path: Path) -> list[dict]:
    """Every measured record (no error) of every run in `path`, with its GPU."""
    records = []
    for run in json.loads(path.read_text()):
        gpu = "h200" if "H200" in run["env"].get("gpu", "") else "h100-sxm"
        for record in run["records"]:
            if "step_s" in record:
                records.append({**record, "gpu": gpu, "commit": run["env"].get("commit")})
    return records


def model_of(record: dict, folder: Path):
    if record.get("hf_config") is None:
        return load_model_config(record["model"])
    path = folder / f"{record['model']}.json"
    path.write_text(json.dumps({**record["hf_config"], "_name_or_path": record["model"]}))
    return from_hf_config(path)


def strategy_of(record: dict) -> Strategy:
    fields = dict(record["strategy"])
    fields["lora_targets"] = tuple(fields["lora_targets"])
    fields["teacher"] = None
    return Strategy(**fields)


def predict(cases) -> list[float]:
    return [
        time_model.step_time(model, strategy, GPUS[gpu]).total_s for model, strategy, gpu in cases
    ]


def fit_constants(names: list[str], cases, measured: list[float]) -> None:
    """Least squares on log(predicted / measured) over `cases`, moving the constants `names`
    (within BOUNDS) and leaving them set on memfit.planner.time."""
    from scipy.optimize import least_squares

    start = [get_constant(CONSTANTS[n]) for n in names]
    low = [BOUNDS.get(n, (0.0, math.inf))[0] for n in names]
    high = [BOUNDS.get(n, (0.0, math.inf))[1] for n in names]

    def residuals(values):
        for name, value in zip(names, values, strict=True):
            set_constant(CONSTANTS[name], value)
        return [math.log(p / m) for p, m in zip(predict(cases), measured, strict=True)]

    result = least_squares(residuals, start, bounds=(low, high), x_scale="jac", diff_step=1e-4)
    residuals(result.x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--score", action="store_true", help="score time.py's constants only")
    parser.add_argument(
        "--only", nargs="+", choices=list(CONSTANTS), metavar="CONSTANT",
        help="fit these constants only, the others kept as time.py has them",
    )  # fmt: skip
    args = parser.parse_args()
    records = load_records(args.results)
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(model_of(r, Path(tmp)), strategy_of(r), r["gpu"]) for r in records]
    measured = [r["step_s"] for r in records]
    if not args.score:
        stages = [(args.only, FITTED_PARTS)] if args.only else STAGES
        for names, parts in stages:
            fit = [i for i, r in enumerate(records) if r["part"] in parts]
            fit_constants(names, [cases[i] for i in fit], [measured[i] for i in fit])
            print(f"constants fitted on {len(fit)} records ({', '.join(parts)}):")
            for name in names:
                print(f"  {name} = {get_constant(CONSTANTS[name]):.4g}")

    predicted = predict(cases)
    by_part: dict[str, list[float]] = {}
    for r, p, m in zip(records, predicted, measured, strict=True):
        error = p / m - 1
        by_part.setdefault(r["part"], []).append(error)
        print(
            f"{r['part']:9} {r['model']:18} seq {r['seq_len']:5} mb {r['micro_batch']:2} "
            f"x{r['grad_accum']:<2} {r['strategy']['checkpointing']:9} "
            f"{r['strategy']['checkpoint_blocks'] or '':>3} {r['precision']} "
            f"measured {m * 1e3:8.1f} ms predicted {p * 1e3:8.1f} ({error:+.1%})"
        )
    for part, errors in by_part.items():
        worst = max(errors, key=abs)
        rms = math.sqrt(sum(e * e for e in errors) / len(errors))
        print(f"{part}: {len(errors)} records, worst {worst:+.1%}, rms {rms:.1%}")


if __name__ == "__main__":
    main()
