"""Sparse attention: memfit.sparse_attention against torch.compile(flex_attention) with the same
masks, the same GPU and process, forward and forward + backward, over the sequence length; and
memfit's dense causal FlashAttention as the baseline every pattern must undercut.

Shapes as ../shared/ANCHORS.md's "Sparse attention" table: batch 1, 16 heads, head dim 128,
bf16. Patterns (memfit.ops.attention.sparse; Flex gets the same token mask as a mask_mod, its
block mask built once per shape, outside the timing):

    local       causal window of 512
    strided     causal window of 256 + every 256th column (the Sparse Transformer's)
    dilated     causal, every 4th token (memfit: the 4 interleaved subsequences)
    longformer  bidirectional window of 256 each side + 64 global tokens (the first 64)
    bigbird     bidirectional, tiles of 128: 3-tile window, 2 global tiles, 3 random tiles

Systems: "memfit" (memfit.sparse_attention: the local window runs memfit's FlashAttention with
that window; the dilated pattern, dense causal attention on each of its 4 subsequences, runs
memfit's FlashAttention there from subsequences of 8k tokens; the others the block-sparse
kernels), "memfit block-sparse kernels" (local and dilated on the block-sparse kernels at every
length), "flex".

    python benchmarks/sparse_attention.py                       # N = 16k and 64k
    python benchmarks/sparse_attention.py --lengths 4096 16384 65536 131072 --systems memfit
    python benchmarks/sparse_attention.py --train                # llama-1b training at 16k
    python benchmarks/sparse_attention.py --decode --lengths 8192 32768 131072  # paged decode
    python benchmarks/sparse_attention.py --kernels --patterns local   # kernel and host time

--kernels: per forward + backward call, each system's GPU kernel time (torch.profiler, summed
over the call's kernels) and the host's time to issue the call, next to the CUDA-event time:
where the host's time nears the kernels', back-to-back calls are bound by the host.

--train: `memfit train`'s engine on llama-1b shapes (random weights, max_seq_len raised to the
length) at sequence 16384, micro-batch 1, bf16, full checkpointing: dense memfit flash against
the Longformer and BigBird patterns on every layer; tokens/s (median step after warm-up) and
peak memory.

Time: median of CUDA-event times after warm-up (compilation, autotuning, layout and block-mask
construction excluded); and the same forward + backward captured ten times in a CUDA graph and
replayed (`forward_backward_graph_ms`), the device's time with the host's taken out for every
system alike. Extra memory: peak allocated during a forward + backward minus what
was allocated before it (q, k, v, dout).
"""

from __future__ import annotations

import argparse

import harness
import torch

from memfit.ops.attention import block_sparse, flash_attention, sparse, sparse_attention
from memfit.ops.attention.block_sparse import GPU_BLOCK
from memfit.ops.attention.sparse import CAUSAL, FULL

HEADS, DIM = 16, 128
FLASH_FROM = block_sparse.DENSE_TO_FLASH


def patterns(seqlen: int) -> dict[str, sparse.Pattern]:
    tiles = seqlen // 128
    window = torch.zeros(tiles, tiles, dtype=torch.int64)
    for b in range(tiles):
        window[b, max(0, b - 1) : b + 2] = 1
    window[:2, :] = 1
    window[:, :2] = 1
    generator = torch.Generator().manual_seed(0)
    for b in range(tiles):
        free = (window[b] == 0).nonzero().flatten()
        window[b, free[torch.randperm(len(free), generator=generator)[:3]]] = 1
    return {
        "local": sparse.local(512),
        "strided": sparse.strided(256),
        "dilated": sparse.dilated(4),
        "longformer": sparse.longformer(256, list(range(64))),
        "bigbird": sparse.from_blocks(window, block=128),
    }


def block_of(pattern: sparse.Pattern) -> int:
    return pattern.block or 64


def flex_mask_mod(pattern: sparse.Pattern, seqlen: int, device: str = "cuda"):
    """The pattern's token mask as a FlexAttention mask_mod (sparse.dense_mask's rule)."""
    left, right = pattern.window if pattern.window is not None else (-(1 << 30), -(1 << 30))
    stride, k, causal = pattern.stride, pattern.dilation, pattern.causal
    flags = torch.zeros(seqlen, dtype=torch.bool, device=device)
    if pattern.global_tokens:
        flags[list(pattern.global_tokens)] = True
    block = block_of(pattern)
    whole = None
    if pattern.blocks is not None or pattern.random_blocks:
        kinds = sparse.block_layout(pattern, seqlen, block).dense()
        whole = ((kinds == FULL) | (kinds == CAUSAL)).to(device)

    def mask_mod(b, h, q, kv):
        if k > 1:  # dilated: the same residue, within the window of steps
            steps = (q - kv) // k
            allowed = ((q - kv) % k == 0) & (steps <= left) & (steps >= -right)
        else:
            allowed = (kv >= q - left) & (kv <= q + right)
        if stride:
            allowed = allowed | ((kv + 1) % stride == 0)
        if pattern.global_tokens:
            allowed = allowed | flags[q] | flags[kv]
        if whole is not None:
            allowed = allowed | whole[q // block, kv // block]
        if causal:
            allowed = allowed & (kv <= q)
        return allowed

    return mask_mod


def kernel_times(fn, args, calls: int = 5) -> dict:
    """GPU time per forward + backward call by kernel (torch.profiler), and the host's time to
    issue one call (the device drained before and after)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    q, k, v, dout = args

    def both():
        torch.autograd.grad(fn(q, k, v), (q, k, v), dout)

    both()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            both()
        torch.cuda.synchronize()
    kernels = {
        e.key[:60]: e.device_time_total / calls / 1e3
        for e in prof.key_averages()
        if e.device_time_total > 0
    }
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        both()
    host = (time.perf_counter() - start) / 20 * 1e3
    torch.cuda.synchronize()
    return {"kernel_ms": sum(kernels.values()), "kernels_ms": kernels, "host_ms": host}


def measure(fn, args) -> dict:
    q, k, v, dout = args

    def forward():
        with torch.no_grad():
            fn(q, k, v)

    def both():
        out = fn(q, k, v)
        torch.autograd.grad(out, (q, k, v), dout)

    forward_ms = harness.median(harness.time_calls(forward, warmup=3, repeat=10)) * 1e3
    both_ms = harness.median(harness.time_calls(both, warmup=3, repeat=10)) * 1e3
    row = {"forward_ms": forward_ms, "forward_backward_ms": both_ms}
    try:
        row["forward_backward_graph_ms"] = harness.graph_seconds(both, calls=10, repeat=10) * 1e3
    except Exception as error:  # (a system whose call cannot be captured keeps its other times)
        row["graph_error"] = f"{type(error).__name__}: {str(error)[:200]}"
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    both()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - before) / 2**20
    return row | {"extra_mib": extra}


TRAIN_PATTERNS = {
    "dense": "",
    "longformer": "longformer:256:globals=0",
    "bigbird": "bigbird:128:globals=0:random=3:block=128",
}


def train_rows(seqlen: int, steps: int) -> list[dict]:
    import dataclasses
    import gc
    import json
    import tempfile
    import time
    from pathlib import Path

    from memfit.config import build_config
    from memfit.models.config import PRESETS, to_hf_config
    from memfit.train.engine import Trainer

    rows = []
    with tempfile.TemporaryDirectory() as out:
        config_json = Path(out) / "config.json"
        model = dataclasses.replace(PRESETS["llama-1b"], max_seq_len=seqlen)
        config_json.write_text(json.dumps(to_hf_config(model)))
        for name, spec in TRAIN_PATTERNS.items():
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            row = {"pattern": name, "system": "memfit train", "seqlen": seqlen, "spec": spec}
            row["allocated_before_gib"] = torch.cuda.memory_allocated() / 2**30
            try:
                trainer = Trainer(build_config(flags={
                    "model": {"name": str(config_json), "attention_pattern": spec},
                    "data": {"seq_len": seqlen},
                    "train": {"steps": steps, "micro_batch": 1, "precision": "bf16",
                              "checkpointing": "full", "device": "cuda", "lr": 1e-4},
                    "checkpoint": {"out": str(Path(out) / name)},
                }))  # fmt: skip
                times = []
                for i in range(steps):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    trainer.train_step()
                    torch.cuda.synchronize()
                    if i >= 2:
                        times.append(time.perf_counter() - start)
                row["tokens_per_s"] = seqlen / harness.median(times)
                row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
                del trainer
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
            print(row, flush=True)
    return rows


DECODE_PATTERNS = {"dense": (None, 0), "local 256": (256, 0), "strided 256": (256, 256)}


def decode_rows(lengths: list[int], batch: int = 8) -> list[dict]:
    """One decode step of the paged kernels (memfit.ops.attention.paged, the engine's), in a
    CUDA graph as the engine runs it, for `batch` sequences of each length: llama-3-8b's attention shape (32 query heads, 8 kv heads
    of 128), bf16, 16-token pages in a shuffled block table; dense causal, a local window of
    256 and the strided pattern (window 256 + every 256th column)."""
    from memfit.ops.attention.paged import paged_attention

    rows = []
    for n in lengths:
        pages = -(-n // 16)
        g = torch.Generator(device="cuda").manual_seed(0)
        pools = [
            torch.randn(batch * pages, 16, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(2)
        ]
        table = torch.randperm(batch * pages, device="cuda").int().view(batch, pages)
        q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        meta = {
            "block_table": table,
            "seq_lens": torch.full((batch,), n, dtype=torch.int32, device="cuda"),
            "query_start": torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            "max_query_len": 1,
            "max_seq_len": n,
        }
        for name, (window, stride) in DECODE_PATTERNS.items():

            def step(q=q, pools=pools, meta=meta, window=window, stride=stride):
                return paged_attention(q, *pools, **meta, window=window, stride=stride)

            step()  # (compiled, then captured as the engine's decode steps are: GPU time only)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            times = harness.time_calls(graph.replay, warmup=3, repeat=50)
            row = {"seqlen": n, "batch": batch, "pattern": name, "us": harness.median(times) * 1e6}
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument(
        "--patterns", nargs="+", default=["local", "strided", "dilated", "longformer", "bigbird"]
    )
    parser.add_argument(
        "--systems", nargs="+", default=["memfit", "memfit block-sparse kernels", "flex"]
    )
    parser.add_argument("--train", action="store_true", help="the llama-1b training rows")
    parser.add_argument("--train-steps", type=int, default=6)
    parser.add_argument(
        "--decode", action="store_true", help="the paged decode step over --lengths, batch 8"
    )
    parser.add_argument(
        "--kernels", action="store_true", help="kernel time and host time per call as well"
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.decode:
        run = {"env": harness.environment(), "records": decode_rows(args.lengths)}
        print(f"results: {harness.append_results('sparse_decode', run, args.out)}")
        return
    if args.train:
        run = {"env": harness.environment(), "records": train_rows(16384, args.train_steps)}
        print(f"results: {harness.append_results('sparse_attention_train', run, args.out)}")
        return
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # (each pattern, length and grad mode compiles Flex anew: past dynamo's default limit of 8
    # it would fall back to its unfused path, which materializes the scores)
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    flex = torch.compile(flex_attention)
    run = {"env": harness.environment(), "heads": HEADS, "head_dim": DIM, "records": []}
    for n in args.lengths:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, dout = (
            torch.randn(1, n, HEADS, DIM, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(4)
        )
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        rows = []
        dense = {"pattern": "dense causal", "system": "memfit flash"}
        try:
            dense |= measure(lambda q, k, v: flash_attention(q, k, v, causal=True), (q, k, v, dout))
        except torch.OutOfMemoryError as error:
            dense["error"] = str(error)[:200]
        rows.append(dense)
        print(dense | {"seqlen": n}, flush=True)
        for name in args.patterns:
            pattern = patterns(n)[name]
            for system in args.systems:
                row = {"pattern": name, "system": system}
                kernels = system == "memfit block-sparse kernels"
                if kernels and not block_sparse._band_only(pattern):
                    continue  # (the same as "memfit")
                block_sparse.DENSE_TO_FLASH = None if kernels else FLASH_FROM
                block_sparse.BAND_TO_FLASH = not kernels
                try:
                    if system.startswith("memfit"):  # (its layout built once, untimed)
                        tile = sparse.tile_for(pattern, GPU_BLOCK)
                        row["density"] = sparse.block_layout(pattern, n, tile, "cuda").density
                        call = lambda q, k, v, p=pattern: sparse_attention(q, k, v, p)  # noqa: E731
                        row |= measure(call, (q, k, v, dout))
                    else:
                        mask = create_block_mask(
                            flex_mask_mod(pattern, n), None, None, n, n, device="cuda",
                            BLOCK_SIZE=128,
                        )  # fmt: skip
                        call = lambda q, k, v, m=mask: flex(  # noqa: E731
                            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=m
                        ).transpose(1, 2)
                        row |= measure(call, (q, k, v, dout))
                    if args.kernels:
                        row |= kernel_times(call, (q, k, v, dout))
                except Exception as error:  # (Triton's OutOfResources too: kept as a row)
                    row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
                rows.append(row)
                print(row | {"seqlen": n}, flush=True)
                torch.cuda.empty_cache()
        for row in rows:
            row["seqlen"] = n
            run["records"].append(row)
    name = "sparse_attention_kernels" if args.kernels else "sparse_attention"
    print(f"results: {harness.append_results(name, run, args.out)}")


if __name__ == "__main__":
    main()
