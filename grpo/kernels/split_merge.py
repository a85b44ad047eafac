"""The split attention's in-place merge as one Triton kernel (CUDA; docs/design.md §7.1).

`grpo.kernels.tree_split.merge_in_place` folds part 2 (every token over its parent's path) into part 1 (every token over
its own segment) by log-sum-exp. Compiled by inductor it took 0.49 ms per attention layer on an H100 at a
15.6k-token Qwen3-1.7B row (`scripts/bench_attention.py`; its lse operands are [H, N] while the outputs are
[N, H, D]), ~8x the time its ~190 MB take at the card's bandwidth: 12 ms of a 360 ms Qwen3-1.7B step. Here one
program owns BLOCK_N tokens of one head: it reads the lse pairs as contiguous runs, the [BLOCK_N, D] tiles of both
outputs once, and writes the merged tile and lse once (0.10 ms there).

The CPU tests run this kernel in Triton's interpreter against `merge_in_place` (tests/test_split_merge.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def merge(out_a, lse_a, out_b, lse_b, has_parent, out, lse, n, heads, dim,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        h = tl.program_id(1)
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        live = rows < n
        la = tl.load(lse_a + h * n + rows, mask=live, other=0.0)
        parent = tl.load(has_parent + rows, mask=live, other=0) != 0
        lb = tl.load(lse_b + h * n + rows, mask=live & parent, other=float("-inf"))
        lb = tl.where(parent, lb, float("-inf"))  # no keys: FlashAttention's lse there is +inf, its out 0
        top = tl.maximum(la, lb)  # part 1 always has the token itself: la is finite, so is top
        lm = top + tl.log(tl.exp(la - top) + tl.exp(lb - top))
        wa = tl.exp(la - lm)
        wb = tl.exp(lb - lm)
        offs = (rows[:, None] * heads + h) * dim + cols[None, :]
        tile = live[:, None] & (cols[None, :] < dim)
        a = tl.load(out_a + offs, mask=tile, other=0.0).to(tl.float32)
        b = tl.load(out_b + offs, mask=tile & parent[:, None], other=0.0).to(tl.float32)
        merged = a * wa[:, None] + b * wb[:, None]
        tl.store(out + offs, merged.to(out.dtype.element_ty), mask=tile)
        tl.store(lse + h * n + rows, lm, mask=live)

    return triton, merge


def merge_rows_triton(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor,
                      has_parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, H, D] in out_a's dtype, lse [H, N] fp32): `merge_in_place`'s result, one kernel launch. out_a /
    out_b [N, H, D], lse_a / lse_b [H, N] fp32, has_parent [N] bool."""
    triton, merge = _kernel()
    n, heads, dim = out_a.shape
    out_a, out_b = out_a.contiguous(), out_b.contiguous()
    lse_a, lse_b = lse_a.float().contiguous(), lse_b.float().contiguous()
    out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
    if n == 0 or heads == 0:
        return out, lse
    block_n = 64 if dim <= 128 else 32
    grid = (triton.cdiv(n, block_n), heads)
    with torch.cuda.device(out_a.device) if out_a.is_cuda else contextlib.nullcontext():  # a rank's own GPU
        merge[grid](out_a, lse_a, out_b, lse_b, has_parent.contiguous().view(torch.uint8), out, lse, n, heads, dim,
                    BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(dim))
    return out, lse
