"""The cost of rotating keys in the paged write (issue 19): `memfit.ops.paged_write.
rotary_paged_write` into fp8 and int8 pools with and without `key_rotation` (the random-sign
Hadamard matrix quantized KV caches store keys under), GQA 32/8, head dims 64 and 128, 1 to 2048
tokens a call (decode steps to prefill chunks), 16-token pages, slots scattered at random.
Times: CUDA-graph replays (harness.graph_seconds), microseconds a call.

    python benchmarks/kv_rotation.py
"""

from __future__ import annotations

import argparse
import functools

import torch
from harness import append_results, environment, graph_seconds

from memfit.inference.paged_cache import key_rotation
from memfit.ops.paged_write import rotary_paged_write
from memfit.ops.rotary import rotary_cos_sin

BLOCKS, BLOCK_SIZE = 4096, 16


def time_write(heads_q: int, heads_kv: int, head_dim: int, tokens: int) -> dict:
    width = (heads_q + 2 * heads_kv) * head_dim
    qkv = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    cos, sin = rotary_cos_sin(torch.arange(tokens, device="cuda"), head_dim, 500000.0, None,
                              device="cuda")  # fmt: skip
    slots = torch.randperm(BLOCKS * BLOCK_SIZE, device="cuda")[:tokens]
    offset = torch.randn(heads_kv, head_dim, device="cuda")
    row = {"heads_q": heads_q, "heads_kv": heads_kv, "head_dim": head_dim, "tokens": tokens}
    for kind, dtype in (("fp8", torch.float8_e4m3fn), ("int8", torch.int8)):
        pools = [torch.zeros(BLOCKS, BLOCK_SIZE, heads_kv, head_dim, dtype=dtype, device="cuda")
                 for _ in "kv"]  # fmt: skip
        if kind == "fp8":  # one power-of-two scale a kv head
            scales = [torch.full((heads_kv,), 2.0**-4, device="cuda") for _ in "kv"]
        else:  # one scale a token and kv head, written by the kernel
            scales = [torch.ones(BLOCKS, BLOCK_SIZE, heads_kv, dtype=torch.float16, device="cuda")
                      for _ in "kv"]  # fmt: skip
        for name, rotation in (("plain", None), ("rotated", key_rotation(head_dim).cuda())):
            write = functools.partial(
                rotary_paged_write, qkv, cos, sin, *pools, slots, heads_q=heads_q,
                key_offset=offset, k_scale=scales[0], v_scale=scales[1], key_rotation=rotation,
            )  # fmt: skip
            write()
            row[f"{kind}_{name}_us"] = graph_seconds(write) * 1e6
        row[f"{kind}_rotated_over_plain"] = row[f"{kind}_rotated_us"] / row[f"{kind}_plain_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="a folder for the results (default benchmarks/results)")
    args = parser.parse_args()
    rows = []
    for head_dim in (64, 128):
        for tokens in (1, 64, 256, 2048):
            rows.append(time_write(32, 8, head_dim, tokens))
            print({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()})
    print("wrote", append_results("kv_rotation", {"env": environment(), "rows": rows}, args.out))


if __name__ == "__main__":
    main()
