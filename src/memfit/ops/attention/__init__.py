"""FlashAttention in Triton: exact attention in tiles, forward and backward, never materializing
the (seqlen_q, seqlen_k) scores.

Algorithm (Dao et al. 2022, "FlashAttention", and Dao 2023, "FlashAttention-2"): a program owns a
block of BLOCK_M query rows of one (sequence, head) and walks the key/value blocks its rows may
see, keeping a running row maximum m, a running sum l of exp(s - m) and an unnormalized output
accumulator (the online softmax), all in fp32 registers. Scores are scaled by
softmax_scale * log2(e) and exponentiated with exp2. At the end it writes

    out = acc / l          (in the input dtype)
    lse = m + log(l)       (fp32, natural log; -inf for a row that sees no key)

and nothing else is kept for backward. The backward recomputes the probabilities block by block
from q, k and lse: with delta = rowsum(dout * out) (one small kernel),

    p = exp(s - lse),  dv = p^T dout,  dp = dout v^T,  ds = p * (dp - delta),
    dq = scale * ds k,  dk = scale * ds^T q.

One launch runs two kinds of programs (FlashAttention-2's split, as in FlexAttention's backward):
the first walk one key/value block over the query blocks that see it and accumulate dk and dv
in registers, summing over every query head of a GQA group, so K and V are never repeated and
dk/dv need no atomics; the others walk one query block over its key blocks and accumulate dq.
Nothing is added atomically, so the backward is deterministic: reruns are bitwise equal.

Masks. Query row i of a sequence sits at aligned position p = i + seqlen_k - seqlen_q (the causal
diagonal is aligned bottom-right, FlashAttention-2's convention, so a decode step sees the whole
cache) and sees keys j with p - left <= j <= p + right; causal is right = 0. A program visits only
the key blocks that intersect this band (FA2's causal block skipping, FlexAttention's sliding
window block skipping), in three runs: masked blocks at the band's left edge, unmasked blocks in
the middle (no index arithmetic, no bounds checks), masked blocks at the right edge and at the
end of the sequence; a band of at most 512 keys in one masked run (launch.MERGE_BAND: each run
starts and drains its own software pipeline, which costs more than the masks over a few blocks).
Query rows and keys past the sequence end are loaded as zeros and never
stored, so any length works, not only multiples of the block size.

Layouts. q, k, v, out: (batch, seqlen, heads, head_dim) with any strides whose last is 1 (e.g.
views into a fused qkv projection); lse: (batch, heads_q, seqlen_q). Packed variable-length
batches (`flash_attention_varlen`) take (total_tokens, heads, head_dim) and cumulative sequence
offsets cu_seqlens (int32, batch + 1 entries); each program reads its sequence's bounds, so
documents never see each other. Head dims up to 256 that are multiples of 8 run; a head dim that is
not a power of two is padded to one inside the kernel (masked loads), e.g. 96 -> 128.

Block sizes and pipelining depth are autotuned per head dim (Triton's autotuner, on CUDA).
Under Triton's interpreter (tests on CPU) fixed 16x16 blocks run, so that small test shapes still
cover multi-block and partial-block paths.

Files: `tiles.py` (shared tile and mask helpers), `forward.py` and `backward.py` (the kernels),
`launch.py` (configurations and launchers), `interface.py` (validation, the torch.library ops,
autograd, the public functions); `paged.py` (the paged decode kernel); `sparse.py` (sparse
patterns and their block layouts) and `block_sparse.py` (`sparse_attention`, the block-sparse
kernels), reusing the tile helpers.
"""

from memfit.ops.attention.block_sparse import sparse_attention, sparse_attention_varlen
from memfit.ops.attention.interface import (
    SUPPORTED_HEAD_DIMS,
    flash_attention,
    flash_attention_varlen,
    head_dim_supported,
)

__all__ = [
    "SUPPORTED_HEAD_DIMS",
    "flash_attention",
    "flash_attention_varlen",
    "head_dim_supported",
    "sparse_attention",
    "sparse_attention_varlen",
]
