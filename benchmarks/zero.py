"""Data-parallel training on N GPUs: memfit's ZeRO stages against torch DDP and FSDP2.

    python benchmarks/zero.py --gpus 2                      # llama-1b mb4 and llama-2-7b mb2 full
    python benchmarks/zero.py --gpus 2 --presets llama-1b --systems ddp zero1 fsdp2
    python benchmarks/zero.py --gpus 1 --presets llama-2-7b --systems zero0+offload zero3+offload
    python benchmarks/zero.py --gpus 8 --presets llama-2-7b llama-2-13b   # the scaling run

Each (preset, system) runs as its own `torchrun --nproc_per_node N` job on the same inputs (the
built-in data, seq 2048): memfit systems are `memfit train` as the engine runs it (`--zero S`,
bf16 autocast over fp32 master weights, fused AdamW, blocks compiled unless checkpointed;
`zero0+offload` is `--offload optimizer`, `zero3+offload` is `--zero 3 --offload params`); `ddp`
is torch DistributedDataParallel around the same model, same autocast, same optimizer; `fsdp2`
is torch's `fully_shard` per transformer block and on the root, bf16 parameters and fp32
gradient reduction (the settings of ../shared/ANCHORS.md). Recorded per run: tokens/s per GPU
(median step after warm-up, every system timed by the harness's wall clock around its whole
step), peak allocated bytes per rank over the training steps (the peak statistics are reset once
the model and optimizer are built, for every system), and the planner's peak per rank, host
memory and step time for the same strategy, predicted before the job runs (`planned_peak_bytes`,
`planned_host_bytes`, `planned_step_s`; DDP planned as ZeRO-0, FSDP2 as ZeRO-3): report.py shows
these, never a later planner's figures.
A job the planner puts over the GPU's memory (or, offloaded, over the host's) is not launched: its
record says why. Results: benchmarks/results/zero.json (`--out DIR` elsewhere).

NVLink multicast stays off in every child (NCCL_NVLS_ENABLE=0 and friends), as the GPU machines
need.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

PRESETS = {  # name: (micro_batch, checkpointing)
    "llama-1b": (4, "none"),
    "llama-2-7b": (2, "full"),
    "llama-2-13b": (2, "full"),
    "llama-3-70b": (1, "full"),
}
SYSTEMS = ("ddp", "zero0", "zero1", "zero2", "zero3", "fsdp2", "zero0+offload", "zero3+offload")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument(
        "--presets", nargs="+", default=["llama-1b", "llama-2-7b"], choices=list(PRESETS)
    )
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, help="instead of the preset's")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeat", type=int, default=8)
    p.add_argument("--timeout", type=int, default=900, help="seconds per (preset, system) job")
    p.add_argument(
        "--force", action="store_true", help="launch jobs the planner says do not fit, too"
    )
    p.add_argument("--out", type=Path, default=harness.RESULTS)
    p.add_argument(
        "--worker", nargs=3, metavar=("PRESET", "SYSTEM", "RESULT"), help=argparse.SUPPRESS
    )
    return p.parse_args(argv)


# --------------------------------------------------------------------------------------------
# inside torchrun: one (preset, system)


def shape(args, preset: str) -> tuple[int, str, int]:
    """(micro-batch, checkpointing, gradient accumulation) of a preset's jobs."""
    micro_batch, checkpointing = PRESETS[preset]
    return args.micro_batch or micro_batch, checkpointing, args.grad_accum


def zero_and_offload(system: str) -> tuple[int, str]:
    """The ZeRO stage and offload of a system; torch's as the memfit strategy planned for them."""
    if system in ("ddp", "fsdp2"):
        return (0 if system == "ddp" else 3), "none"
    stage, _, offload = system.removeprefix("zero").partition("+")
    zero = int(stage)
    return zero, ("params" if zero == 3 else "optimizer") if offload else "none"


def _memfit_worker(args, preset: str, system: str, run_dir: str) -> tuple[list[float], int]:
    from memfit.config import build_config
    from memfit.train.engine import Trainer

    micro_batch, checkpointing, grad_accum = shape(args, preset)
    zero, offload = zero_and_offload(system)
    config = build_config(
        flags={
            "model": {"name": preset},
            "data": {"seq_len": args.seq_len},
            "train": {
                "steps": args.warmup + args.repeat,
                "micro_batch": micro_batch,
                "grad_accum": grad_accum,
                "checkpointing": checkpointing,
                "precision": "bf16",
                "device": "cuda",
            },
            "distributed": {"zero": zero, "offload": offload},
            "checkpoint": {"out": run_dir},
        }
    )
    trainer = Trainer(config)
    torch.cuda.reset_peak_memory_stats()
    times = harness.time_calls(
        trainer.train_step, warmup=args.warmup, repeat=args.repeat, clock="wall"
    )
    return times, micro_batch * args.seq_len * grad_accum


def _torch_worker(args, preset: str, system: str) -> tuple[list[float], int]:
    import torch.distributed as dist

    from memfit.models.config import load_model_config
    from memfit.models.llama import build_model
    from memfit.optim import parameter_groups
    from memfit.train.checkpointing import apply_activation_checkpointing

    micro_batch, checkpointing, grad_accum = shape(args, preset)
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    model_config = load_model_config(preset)
    model = build_model(model_config, device=device, attention="sdpa", seed=0)
    apply_activation_checkpointing(model, checkpointing)
    if (
        checkpointing == "none"
    ):  # compiled blocks, as memfit runs them (torchtitan's order for FSDP2)
        for index, block in enumerate(model.layers):
            model.layers[index] = torch.compile(block)
    if system == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
        autocast = True
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        autocast = False
    groups = parameter_groups(model, 0.1)
    optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    generator = torch.Generator(device=device).manual_seed(dist.get_rank())
    vocab = model_config.vocab_size

    def step() -> None:
        for index in range(grad_accum):
            tokens = torch.randint(
                0, vocab, (micro_batch, args.seq_len + 1), device=device, generator=generator
            )
            # DDP reduces on the last micro-batch only (as memfit's stages 0-1); FSDP2 reduces
            # every micro-batch's gradients (as stages 2-3)
            last = index == grad_accum - 1
            sync = model.no_sync() if system == "ddp" and not last else contextlib.nullcontext()
            with sync:
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    loss = model(tokens[:, :-1], tokens[:, 1:]) / tokens[:, 1:].numel()
                (loss / grad_accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()

    torch.cuda.reset_peak_memory_stats()
    times = harness.time_calls(step, warmup=args.warmup, repeat=args.repeat, clock="wall")
    return times, micro_batch * args.seq_len * grad_accum


def worker(args) -> None:
    import torch.distributed as dist

    preset, system, result_path = args.worker
    run_dir = str(Path(result_path).parent / "run")  # the same on every rank (settings must match)
    try:
        _work(args, preset, system, result_path, run_dir)
    except BaseException:
        rank = os.environ.get("RANK", "0")
        Path(f"{result_path}.rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(run_dir, ignore_errors=True)


def _work(args, preset: str, system: str, result_path: str, run_dir: str) -> None:
    import torch.distributed as dist

    if system.startswith("zero"):
        times, tokens = _memfit_worker(args, preset, system, run_dir)
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        times, tokens = _torch_worker(args, preset, system)
    peak = torch.cuda.max_memory_allocated()
    host = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # offload: CPU memory too
    peaks: list = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    if dist.get_rank() == 0:
        step_s = harness.median(times)
        record = {
            "model": preset, "system": system, "gpus": dist.get_world_size(),
            "seq_len": args.seq_len, "step_s": step_s, "step_times_s": times,
            "tokens_per_s_per_gpu": tokens / step_s, "peak_allocated_per_rank": peaks,
            "host_peak_rss_rank0": host,
        }  # fmt: skip
        Path(result_path).write_text(json.dumps(record))
    dist.barrier()


# --------------------------------------------------------------------------------------------
# driver


def planned(args, preset: str, system: str) -> dict:
    """The planner's per-rank peak and step time for this job on this machine's GPU, and why it
    would not fit (None when it does)."""
    from memfit.models.config import load_model_config
    from memfit.planner import Strategy, detect_gpu, plan, step_time

    micro_batch, checkpointing, grad_accum = shape(args, preset)
    zero, offload = zero_and_offload(system)
    strategy = Strategy(
        micro_batch=micro_batch, seq_len=args.seq_len, checkpointing=checkpointing, zero=zero,
        offload=offload, world_size=args.gpus, grad_accum=grad_accum,
    )  # fmt: skip
    model = load_model_config(preset)
    gpu = detect_gpu()
    memory = plan(model, strategy, gpu)
    why = None
    if gpu is not None and not memory.fits:
        why = (
            f"does not fit: planned {memory.required_bytes / 2**30:.1f} GiB per GPU "
            f"> {gpu.memory_bytes / 2**30:.1f} GiB"
        )
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if memory.host_bytes * args.gpus > host:
        why = (
            f"does not fit: planned {memory.host_bytes * args.gpus / 2**30:.0f} GiB of host "
            f"memory > {host / 2**30:.0f} GiB"
        )
    record = {
        "planned_peak_bytes": memory.peak_bytes,
        "planned_host_bytes": memory.host_bytes * args.gpus,
        "planned_step_s": (
            step_time(model, strategy, gpu, host_cpus=os.cpu_count() or 16).total_s
            if gpu is not None
            else None
        ),
        "host_cpus": os.cpu_count(),
    }
    return {**record, "does_not_fit": why}


def run_job(args, preset: str, system: str) -> dict:
    micro_batch, checkpointing, grad_accum = shape(args, preset)
    plans = planned(args, preset, system)
    why = plans.pop("does_not_fit")
    head = {
        "model": preset, "system": system, "gpus": args.gpus, "micro_batch": micro_batch,
        "grad_accum": grad_accum, "checkpointing": checkpointing, "seq_len": args.seq_len,
        **plans,
    }  # fmt: skip
    if why and not args.force:
        return {**head, "skipped": why}
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={args.gpus}", __file__, "--worker", preset, system, str(result),
            "--seq-len", str(args.seq_len), "--warmup", str(args.warmup),
            "--repeat", str(args.repeat), "--grad-accum", str(args.grad_accum),
        ]  # fmt: skip
        if args.micro_batch:
            command += ["--micro-batch", str(args.micro_batch)]
        env = {**os.environ, **harness.SAFE_ENV}
        started = time.perf_counter()
        try:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {**head, "error": f"timed out after {args.timeout} s"}
        if proc.returncode != 0 or not result.exists():
            errors = sorted(Path(tmp).glob("result.json.rank*.err"))
            text = errors[0].read_text() if errors else proc.stdout + proc.stderr
            print(text[-3000:], file=sys.stderr)
            lines = text.strip().splitlines()
            return {**head, "error": (lines[-1] if lines else "")[:300]}
        record = {**head, **json.loads(result.read_text())}
        record["wall_s"] = round(time.perf_counter() - started, 1)
        return record


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"benchmarks/zero.py --gpus {args.gpus} needs that many CUDA GPUs")
    run = {
        "benchmark": "zero",
        "env": harness.environment(),
        "warmup": args.warmup,
        "repeat": args.repeat,
        "records": [],
    }
    for preset in args.presets:
        for system in args.systems:
            record = run_job(args, preset, system)
            run["records"].append(record)
            peaks = record.get("peak_allocated_per_rank") or []
            print(
                f"{preset:11s} {system:6s} "
                + (f"error: {record['error']}" if "error" in record else
                   f"skipped: {record['skipped']}" if "skipped" in record else
                   f"{record['tokens_per_s_per_gpu']:,.0f} tok/s/GPU  peak/rank "
                   + " ".join(f"{p / 2**30:.1f}" for p in peaks) + " GiB"
                   + f"  planned {record['planned_peak_bytes'] / 2**30:.1f} GiB"
                   + (f", {record['planned_step_s']:.3f} s vs {record['step_s']:.3f} s"
                      if record["planned_step_s"] else "")),
                flush=True,
            )  # fmt: skip
    if args.out.resolve() != harness.RESULTS.resolve():
        args.out.mkdir(parents=True, exist_ok=True)
        seed = harness.RESULTS / "zero.json"
        if seed.exists() and not (args.out / "zero.json").exists():
            shutil.copy(seed, args.out / "zero.json")
        harness.RESULTS = args.out
    print("wrote", harness.append_results("zero", run))


if __name__ == "__main__":
    main()
