"""The formulas of a Gated DeltaNet layer outside its scan, as plain differentiable torch: the tree causal conv
written over shifted row slices (what torch.compile fuses), the query/key L2 normalisation and the gates. Both the
eager tree forward (grpo/kernels/gdn.py) and the mixer compiled as one graph (grpo/kernels/gdn_graph.py) call them,
so they sit below both."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm_leading(out: torch.Tensor, channels: int, head_dim: int) -> torch.Tensor:
    """out [N, C] with its first `channels` columns L2-normalised in groups of `head_dim` (eps 1e-6, computed in fp32
    or wider, returned in out's dtype): FLA's and transformers' query/key normalisation."""
    n_tokens, acc = out.shape[0], torch.promote_types(out.dtype, torch.float32)
    qk = out[:, :channels].to(acc).reshape(n_tokens, channels // head_dim, head_dim)
    qk = qk * torch.rsqrt((qk * qk).sum(-1, keepdim=True) + 1e-6)
    return torch.cat([qk.reshape(n_tokens, channels).to(out.dtype), out[:, channels:]], dim=1)


def tree_conv_formula(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fix_index: torch.Tensor,
                      fix_window: torch.Tensor, silu: bool, qk_norm: tuple[int, int] | None = None) -> torch.Tensor:
    """`tree_causal_conv1d` as one differentiable formula over shifted row slices (the conv, the recomputed segment
    starts, bias, SiLU, the query/key normalisation): what torch.compile fuses into a few kernels
    (`compile_tree_conv`). Eager, it would keep K_c fp32 products for autograd; the eager path runs
    `_ContiguousDepthwiseConv` (saves x and the weight only).
    x [N, C] in the weight dtype, fix_window [M, K_c] = conv_index[fix_index] (N = a zero tap) -> [N, C]."""
    n_tokens, kernel_size = x.shape[0], weight.shape[1]
    acc = torch.promote_types(weight.dtype, torch.float32)
    padded = F.pad(x, (0, 0, kernel_size - 1, 1))  # [K_c - 1 + N + 1, C]: zeros before row 0, one zero row after
    out = x.to(acc) * weight[:, -1].to(acc)  # [N, C], tap i reads padded[n + i] = x[n - (K_c - 1 - i)]
    for tap in range(kernel_size - 1):
        out = out + padded[tap:tap + n_tokens].to(acc) * weight[:, tap].to(acc)
    taps = padded[fix_window + (kernel_size - 1)]  # [M, K_c, C]; index N lands on the trailing zero row; M may be 0
    out = out.index_put((fix_index,), (taps.to(acc) * weight.t().to(acc)).sum(dim=1))
    out = out.to(weight.dtype)
    if bias is not None:
        out = out + bias
    out = F.silu(out) if silu else out
    return out if qk_norm is None else l2norm_leading(out, *qk_norm)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple:
    """(g, beta) of a GDN layer from its in_proj_a / in_proj_b outputs [N, H_v]: the log decay
    g = -exp(A_log) softplus(a + dt_bias) in fp32, and beta = sigmoid(b), as transformers' layer computes them."""
    return -a_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()
