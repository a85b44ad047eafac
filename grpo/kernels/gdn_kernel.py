"""The gated delta rule's kernels in torch: the chunked WY/UT kernel the trainer runs and the token-by-token reference.

The recurrence S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T, o_t = S_t q_t (Gated DeltaNet, arXiv 2412.06464).
`chunk_gated_delta_rule` works in 64-token chunks (FLA's chunk algorithm): everything inside a chunk is batched
matmuls over all chunks at once; the only sequential work is one [D_k, D_k] x [D_k, D_v] matmul per chunk
(`_ChunkScan`, with a hand-written reverse scan as its backward). `sequential_gated_delta_rule` is the reference it
is tested against. Both take transformers' / FLA's padded signature; grpo/kernels/gdn.py runs them per trie level.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
"""Chunk length of the torch kernel; a trie level's padded length is a multiple of it."""

def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim, the normalisation of transformers' and FLA's GDN kernels."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class _ScaledL2Norm(torch.autograd.Function):
    """scale * l2norm(x) keeping only its output (and 1/|x|) for the backward, not x as well:
    dx = r (dy - y (y . dy)) with y = x r, r = (|x|^2 + eps)^-1/2, dy = scale d out."""

    @staticmethod
    def forward(ctx, x, scale: float):
        r = torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        out = x * (r * scale)
        ctx.save_for_backward(out, r)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        out, r = ctx.saved_tensors
        y = out / ctx.scale
        dy = grad * ctx.scale
        return r * (dy - y * (y * dy).sum(-1, keepdim=True)), None


def _accumulation_dtype(*tensors) -> torch.dtype:
    """fp32, or fp64 when an input is fp64 (gradcheck)."""
    dtype = torch.float32
    for t in tensors:
        if t is not None:
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def sequential_gated_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=False, **_):
    """The gated delta rule token by token, in fp32 (fp64 for fp64 inputs): the reference implementation.

    Same arguments and returns as `chunk_gated_delta_rule`: query/key [B, T, H, D_k], value [B, T, H, D_v],
    g (log decay, <= 0) / beta [B, T, H], initial_state [B, H, D_k, D_v]. Per step:
    S <- e^{g_t} S; S <- S + k_t (beta_t (v_t - S^T k_t))^T; o_t = S^T q_t / sqrt(D_k).
    """
    acc = _accumulation_dtype(query, key, value, initial_state)
    batch, length, heads, d_k = key.shape
    q, k, v = (t.to(acc).transpose(1, 2) for t in (query, key, value))  # [B, H, T, D]
    g, beta = (t.to(acc).transpose(1, 2) for t in (g, beta))  # [B, H, T]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * d_k ** -0.5
    state = (torch.zeros(batch, heads, d_k, v.shape[-1], dtype=acc, device=q.device) if initial_state is None
             else initial_state.to(acc))  # [B, H, D_k, D_v]
    outputs = []
    for t in range(length):
        state = state * g[:, :, t, None, None].exp()
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, :, t]))  # [B, H, D_v]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, :, t]))
    out = torch.stack(outputs, dim=1) if outputs else v.new_zeros(batch, 0, heads, v.shape[-1])  # [B, T, H, D_v]
    return out.to(query.dtype), state if output_final_state else None


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + a)^-1 for strictly lower-triangular a [..., C, C], C a power of two (differentiable).

    Recursive 2 x 2 block inversion [[X, 0], [Y, Z]]^-1 = [[X^-1, 0], [-Z^-1 Y X^-1, Z^-1]], from 1 x 1 blocks up:
    log2(C) levels, each two batched matmuls over every diagonal-block pair. Numerically this is a blocked
    forward substitution (it never forms powers of `a`, whose Neumann series can grow huge for the delta rule's
    nearly parallel keys). The backward is d a = -(T^T dT T^T) below the diagonal (T = the inverse), so autograd
    keeps only T, not the levels' intermediates.
    """
    return _UnitLowerInverse.apply(a)


class _UnitLowerInverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        inverse = _unit_lower_inverse_values(a)
        ctx.save_for_backward(inverse)
        return inverse

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        t_t = inverse.transpose(-1, -2)
        return -(t_t @ grad @ t_t).tril(-1)


def _unit_lower_inverse_values(a: torch.Tensor) -> torch.Tensor:
    c = a.shape[-1]
    if c & (c - 1):
        raise ValueError(f"chunk size {c} is not a power of two")
    lead = a.shape[:-2]
    inverse = None  # [..., n_blocks, b, b]: inverses of the diagonal b x b blocks
    b = 1
    while b < c:
        n = c // (2 * b)
        lower = a.reshape(*lead, n, 2, b, n, 2, b)[..., 1, :, :, 0, :]  # [..., n, b, n, b]
        lower = torch.diagonal(lower, dim1=-4, dim2=-2).movedim(-1, -3)  # [..., n, b, b]: block (2m+1, 2m)
        if inverse is None:  # 1 x 1 unit diagonal blocks: their inverses are 1
            top_left = bottom_right = torch.ones_like(lower)
            bottom_left = -lower
        else:
            top_left, bottom_right = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
            bottom_left = -(bottom_right @ lower @ top_left)
        inverse = torch.cat([torch.cat([top_left, torch.zeros_like(lower)], -1),
                             torch.cat([bottom_left, bottom_right], -1)], -2)  # [..., n, 2b, 2b]
        b *= 2
    return inverse[..., 0, :, :] if inverse is not None else torch.ones_like(a)


def _chunk_prepare(q, k, v, g, beta, mm: torch.dtype):
    """Everything of the chunked rule that does not depend on the state, batched over all chunks.

    q/k [..., C, D_k] (normalised, q scaled), g/beta [..., C] in the accumulation dtype `acc`, v [..., C, D_v] in
    acc or `mm`, the operand dtype of the large matmuls (acc, or bf16 for bf16 inputs). With G_r = sum_{i<=r} g_i
    within the chunk, S_0 the state entering it and T = (I + A)^-1, A_rj = beta_r e^{G_r - G_j} k_r.k_j (j < r):
    the chunk's deltas are U - W S_0 (U = T (beta v), W = T (beta e^G k)), its outputs
    (e^G q) S_0 + (q k^T o e^{G_r - G_j})_{j<=r} (U - W S_0), and the state leaving it is trans S_0 + rhs with
    trans = e^{G_C} I - (e^{G_C - G} k)^T W, rhs = (e^{G_C - G} k)^T U. Returns (qd, attn, u, w, gamma = e^{G_C}
    [...], k_end = e^{G_C - G} k [..., C, D_k], rhs); `_ChunkScan` forms trans from gamma, k_end and w.
    """
    acc = q.dtype
    c = q.shape[-2]
    cum = g.cumsum(-1)  # [..., C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # [..., C, C]
    q_mm, k_mm = q.to(mm), k.to(mm)
    k_t = k_mm.transpose(-1, -2)
    # matmul results enter fp32 products as they are (type promotion): autograd keeps them in the matmul dtype
    a = ((k_mm @ k_t) * (decay * beta[..., :, None])).tril(-1)  # [..., C, C] strictly lower, acc
    attn = (q_mm @ k_t) * decay  # [..., C, C], diagonal included, acc
    t = unit_lower_inverse(a).to(mm)  # [..., C, C]
    u = t @ (v * beta[..., None]).to(mm)  # [..., C, D_v]
    w = t @ (k * (beta * cum.exp())[..., None]).to(mm)  # [..., C, D_k]
    last = cum[..., -1:]  # [..., 1]
    k_end = k * (last - cum).exp()[..., None]  # [..., C, D_k]: keys decayed to the chunk end
    rhs = k_end.transpose(-1, -2) @ u.to(acc)  # [..., D_k, D_v]; the state recurrence stays in acc
    qd = q * cum.exp()[..., None]  # [..., C, D_k]
    return qd, attn, u, w, last[..., 0].exp(), k_end, rhs


def _chunk_output(qd, attn, u, w, states, mm: torch.dtype):
    """Outputs of every chunk from the states entering them (states [..., D_k, D_v]); see `_chunk_prepare`."""
    acc = qd.dtype
    s = states.to(mm)
    delta = u.to(acc) - (w @ s).to(acc)  # [..., C, D_v]: the delta rule's corrected values
    return (qd.to(mm) @ s).to(acc) + (attn.to(mm) @ delta.to(mm)).to(acc)  # [..., C, D_v]


class _ChunkScan(torch.autograd.Function):
    """states[0] = state, states[i + 1] = trans_i states[i] + rhs_i with trans_i = gamma_i I - k_end_i^T w_i: the
    only sequential part, one batched matmul per chunk (trans is formed in one batched matmul up front).

    The backward is the reverse scan lam_i = grad_i + trans_i^T lam_{i+1} (one matmul per chunk), then
    d trans_i = lam_{i+1} states_i^T in one batched matmul, and d gamma, d k_end, d w from it. Autograd keeps the
    states once and not trans (recomputed from gamma, k_end and w, which the output's matmuls keep anyway)."""

    @staticmethod
    def _trans(gamma, k_end, w):
        eye = torch.eye(k_end.shape[-1], dtype=k_end.dtype, device=k_end.device)
        return gamma[..., None, None] * eye - k_end.transpose(-1, -2) @ w.to(k_end.dtype)  # [NC, M, D_k, D_k]

    @staticmethod
    def forward(ctx, gamma, k_end, w, rhs, state):
        # gamma [NC, M], k_end [NC, M, C, D_k] (acc), w [NC, M, C, D_k] (matmul dtype), rhs [NC, M, D_k, D_v],
        # state [M, D_k, D_v]; returns states [NC + 1, M, D_k, D_v], the state entering each chunk, then the last
        trans = _ChunkScan._trans(gamma, k_end, w)
        states = state.new_empty((trans.shape[0] + 1, *state.shape))
        states[0] = state
        for i in range(trans.shape[0]):
            torch.baddbmm(rhs[i], trans[i], states[i], out=states[i + 1])
        ctx.save_for_backward(gamma, k_end, w, states)
        return states

    @staticmethod
    def backward(ctx, grad_states):
        gamma, k_end, w, states = ctx.saved_tensors
        trans = _ChunkScan._trans(gamma, k_end, w)
        lam = torch.empty_like(states)  # dL/d states[i], all paths
        lam[-1] = grad_states[-1]
        for i in reversed(range(trans.shape[0])):
            torch.baddbmm(grad_states[i], trans[i].transpose(-1, -2), lam[i + 1], out=lam[i])
        grad_trans = lam[1:] @ states[:-1].transpose(-1, -2)  # [NC, M, D_k, D_k]
        grad_gamma = grad_trans.diagonal(dim1=-2, dim2=-1).sum(-1)
        grad_k_end = -(w.to(k_end.dtype) @ grad_trans.transpose(-1, -2))  # [NC, M, C, D_k]
        grad_w = -(k_end @ grad_trans)  # [NC, M, C, D_k]
        return grad_gamma, grad_k_end, grad_w.to(w.dtype), lam[1:], lam[0]


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size: int = CHUNK, initial_state=None,
                           output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                           matmul_dtype: torch.dtype | None = None, **_):
    """The chunked gated delta rule in torch (the signature of transformers' / FLA's padded call).

    query/key [B, T, H, D_k], value [B, T, H, D_v], g (log decay, <= 0) / beta [B, T, H], initial_state
    [B, H, D_k, D_v] or None; returns (output [B, T, H, D_v] in query's dtype, final state [B, H, D_k, D_v] in
    fp32 or None). T needs no particular length (zero g/beta padding to a chunk multiple is exact). Decays, the
    triangular inverse and the state recurrence are computed in fp32 (fp64 for fp64 inputs); the batched
    intra-chunk and state-read matmuls take `matmul_dtype` operands: by default bf16 for bf16 inputs (as FLA's
    kernels do; fp32 accumulation), else fp32.
    """
    with torch.autocast(query.device.type, enabled=False):  # dtypes are explicit here
        return _chunk_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel, matmul_dtype)


def _chunk_rule(query, key, value, g, beta, chunk_size, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                matmul_dtype):
    acc = _accumulation_dtype(query, key, value, initial_state)
    mm = matmul_dtype or (torch.bfloat16 if query.dtype == torch.bfloat16 else acc)
    batch, length, heads, d_k = key.shape
    d_v = value.shape[-1]
    n_chunks = -(-length // chunk_size)
    pad = n_chunks * chunk_size - length

    def chunked(x, dtype=acc):  # [B, T, H, ...] -> [NC, B, H, C, ...] contiguous
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        x = x.reshape(batch, n_chunks, chunk_size, heads, *x.shape[3:])
        return x.permute(1, 0, 3, 2, *range(4, x.dim())).to(dtype, memory_format=torch.contiguous_format)

    q, k, g, beta = (chunked(t) for t in (query, key, g, beta))
    v = chunked(value, mm if value.dtype == mm else acc)  # only read by one product: kept in bf16 for bf16 inputs
    if use_qk_l2norm_in_kernel:
        q, k = _ScaledL2Norm.apply(q, d_k ** -0.5), _ScaledL2Norm.apply(k, 1.0)
    else:
        q = q * d_k ** -0.5
    qd, attn, u, w, gamma, k_end, rhs = _chunk_prepare(q, k, v, g, beta, mm)
    m = batch * heads
    state = (torch.zeros(m, d_k, d_v, dtype=acc, device=q.device) if initial_state is None
             else initial_state.to(acc).reshape(m, d_k, d_v))
    states = _ChunkScan.apply(gamma.reshape(n_chunks, m), k_end.reshape(n_chunks, m, chunk_size, d_k),
                              w.reshape(n_chunks, m, chunk_size, d_k), rhs.reshape(n_chunks, m, d_k, d_v),
                              state)  # [NC + 1, B H, D_k, D_v]
    out = _chunk_output(qd, attn, u, w, states[:-1].reshape(n_chunks, batch, heads, d_k, d_v), mm)  # [NC,B,H,C,Dv]
    out = out.to(query.dtype).permute(1, 0, 3, 2, 4).reshape(batch, n_chunks * chunk_size, heads, d_v)
    final = states[-1].reshape(batch, heads, d_k, d_v) if output_final_state else None
    return out[:, :length], final


def compile_chunk_regions(**compile_kwargs) -> None:
    """torch.compile the state-independent regions of `chunk_gated_delta_rule` (`_chunk_prepare`, `_chunk_output`:
    their elementwise work fuses; the chunk loop stays eager). dynamic=True by default: rows change length."""
    global _chunk_prepare, _chunk_output
    compile_kwargs.setdefault("dynamic", True)
    if not hasattr(_chunk_prepare, "_grpo_compiled"):
        _chunk_prepare = torch.compile(_chunk_prepare, **compile_kwargs)
        _chunk_prepare._grpo_compiled = True
        _chunk_output = torch.compile(_chunk_output, **compile_kwargs)
        _chunk_output._grpo_compiled = True
