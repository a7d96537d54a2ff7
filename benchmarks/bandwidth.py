"""The rates memfit's time model rests on (planner/time.py), measured on this machine.

    python benchmarks/bandwidth.py --gpus 2          # NCCL across 2 GPUs, and the host's rates
    python benchmarks/bandwidth.py --gpus 1          # the host's rates only

- collectives (N > 1): bus bandwidth of the collectives ZeRO runs, at bucket-like sizes, in the
  convention of nccl-tests: algorithm bandwidth = bytes / time (the whole buffer: all-reduce's
  input, reduce-scatter's input, all-gather's output), bus bandwidth = that x 2(N-1)/N for
  all-reduce and x (N-1)/N for reduce-scatter and all-gather. Bus bandwidth is what one GPU's
  links carry; on a switched NVLink node it stays about the same from 2 to 8 GPUs.
- overlap (N > 1): a bf16 GEMM loop timed alone, and again while 256 MiB all-reduces run beside
  it on another stream, as gradient buckets run beside backward: how much the collectives slow
  the compute (NCCL's kernels take SMs) and what bandwidth they get meanwhile.
- host: pinned host-to-GPU and GPU-to-host copies of 1 GiB, and torch's fused AdamW step on the
  CPU over a flat fp32 shard (parameters per second, torch's default CPU threads): the rates of
  `--offload`.

Results: benchmarks/results/bandwidth.json (`--out DIR` elsewhere). NVLink multicast stays off in
every process (NCCL_NVLS_ENABLE=0 and friends), as the GPU machines need.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

MiB = 2**20
SIZES = (16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_cuda(fn, *, warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds of one call of `fn`: the harness's CUDA-event timer on the current stream,
    the host waiting for each call before launching the next."""
    return harness.median(
        harness.time_calls(fn, warmup=warmup, repeat=repeat, sync_each=True, device="cuda")
    )


def collectives(world: int, device: torch.device) -> list[dict]:
    import torch.distributed as dist

    def cases(size: int) -> dict:
        fp32 = torch.ones(size // 4, device=device)
        bf16 = torch.ones(size // 2, device=device, dtype=torch.bfloat16)
        shard32 = torch.empty(size // 4 // world, device=device)
        shard16 = torch.empty(size // 2 // world, device=device, dtype=torch.bfloat16)
        share = (world - 1) / world
        return {
            "all_reduce": (lambda: dist.all_reduce(fp32), 2 * share),
            "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard32, fp32), share),
            "all_gather": (lambda: dist.all_gather_into_tensor(bf16, shard16), share),
        }

    rows = []
    for size in SIZES:
        for name, (fn, factor) in cases(size).items():
            seconds = _time_cuda(fn)
            rows.append(
                {
                    "collective": name,
                    "bytes": size,
                    "seconds": seconds,
                    "algbw_bytes_per_s": size / seconds,
                    "busbw_bytes_per_s": size / seconds * factor,
                }
            )
    return rows


def overlap(world: int, device: torch.device) -> dict:
    """A GEMM loop alone, and again beside as many 256 MiB all-reduces on a second stream as take
    about as long (the way bucketed gradient collectives run beside backward)."""
    import torch.distributed as dist

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    buffer = torch.ones(256 * MiB // 4, device=device)
    gemms = 40

    def compute():
        for _ in range(gemms):
            torch.mm(a, b)

    alone = _time_cuda(compute)
    reduce_alone = _time_cuda(lambda: dist.all_reduce(buffer))
    reduces = max(1, round(alone / reduce_alone))
    side = torch.cuda.Stream(device)
    samples = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), harness.cuda_span(side) as comm_seconds:
            for _ in range(reduces):
                dist.all_reduce(buffer)
        with harness.cuda_span() as compute_seconds:
            compute()
        torch.cuda.synchronize()
        samples.append((compute_seconds(), comm_seconds()))
    beside, comm = sorted(samples)[len(samples) // 2]
    flops = 2 * 8192**3 * gemms
    bus = buffer.numel() * 4 * 2 * (world - 1) / world
    return {
        "gemm_tflops_alone": flops / alone / 1e12,
        "gemm_tflops_beside_all_reduce": flops / beside / 1e12,
        "compute_slowdown": beside / alone,
        "all_reduce_busbw_alone": bus / reduce_alone,
        "all_reduce_busbw_beside_gemm": bus * reduces / comm,
        "all_reduces_beside": reduces,
    }


def host(device: torch.device) -> dict:
    size = 1024 * MiB
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(size, dtype=torch.uint8, device=device)
    h2d = _time_cuda(lambda: gpu.copy_(pinned, non_blocking=True), warmup=2, repeat=5)
    d2h = _time_cuda(lambda: pinned.copy_(gpu, non_blocking=True), warmup=2, repeat=5)

    numel = 2**28  # 256M parameters: 4 GiB each of parameter, gradient and the two moments
    param = torch.nn.Parameter(torch.zeros(numel))
    param.grad = torch.full((numel,), 1e-3)
    optimizer = torch.optim.AdamW([param], lr=1e-4, fused=True)
    optimizer.step()  # creates the moments
    step = harness.median(harness.time_calls(optimizer.step, warmup=0, repeat=3, device="cpu"))
    return {
        "pinned_h2d_bytes_per_s": size / h2d,
        "pinned_d2h_bytes_per_s": size / d2h,
        "cpu_fused_adamw_params_per_s": numel / step,
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }


def worker(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, device_id=device
    )
    try:
        rows = collectives(world, device)
        lap = overlap(world, device)
        if rank == 0:
            out["collectives"] = rows
            out["overlap"] = lap
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--out", type=Path, default=harness.RESULTS)
    args = p.parse_args(argv)
    if torch.cuda.device_count() < args.gpus:
        raise SystemExit(f"benchmarks/bandwidth.py --gpus {args.gpus} needs that many CUDA GPUs")
    os.environ.update(harness.SAFE_ENV)  # spawned processes inherit it
    run = {"benchmark": "bandwidth", "env": harness.environment(), "gpus": args.gpus}
    if args.gpus > 1:
        import torch.multiprocessing as mp

        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(worker, args=(args.gpus, _free_port(), out), nprocs=args.gpus)
            run.update(dict(out))
        for row in run["collectives"]:
            print(
                f"{row['collective']:15s} {row['bytes'] / MiB:6.0f} MiB  "
                f"bus {row['busbw_bytes_per_s'] / 1e9:6.1f} GB/s",
                flush=True,
            )
        print({k: round(v, 3) for k, v in run["overlap"].items()}, flush=True)
    run["host"] = host(torch.device("cuda", 0))
    print({k: round(v, 3) for k, v in run["host"].items()}, flush=True)
    harness.RESULTS = args.out
    print("wrote", harness.append_results("bandwidth", run))


if __name__ == "__main__":
    main()
