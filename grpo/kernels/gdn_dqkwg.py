"""FLA's gated `chunk_bwd_dqkwg` step in torch, for the GPUs where FLA refuses its own Triton kernel.

FLA's gated delta-rule backward is a chain of Triton kernels; one of them, `chunk_bwd_dqkwg` (dq, dk, dw and dg of
each 64-token chunk from the chunk's states h, their gradients dh, do, dv and the gates), is miscompiled by Triton
>= 3.4.0, < 3.7.1 on Hopper, and FLA raises there instead of returning wrong gradients. Every chunk's work is
independent of the others (no recurrence), so it is a handful of batched matmuls over all chunks at once:
`chunk_bwd_dqkwg` here computes what FLA's kernel computes, in the same precision steps (16-bit operands, fp32
accumulation: on CUDA 16-bit GEMMs with fp32 output; the intra-chunk score gradient rounded to the input dtype
before its two matmuls), with FLA's signature, so grpo/kernels/gdn_choice.py can put it in place of FLA's while every
other FLA kernel stays.

Per chunk c (rows t, columns s within the chunk, last valid row L, gates g in log2 space, cumulative in the chunk):
  dq = (do h^T) * 2^g * scale + dS k,       dk = (v dh^T) * 2^(g_L - g) + dS^T q,     dw = -(dv h^T)
  dS = tril(do v^T * 2^(g_t - g_s)) * scale,  dg = rowsum(dq * q) - rowsum(dk * k), plus at row L:
  2^(g_L) * sum(h * dh) + sum(dk_state * k)   (dk_state: dk before its dS^T q term)
"""

from __future__ import annotations

import torch


def chunk_bwd_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None):
    """FLA's `fla.ops.common.chunk_o.chunk_bwd_dqkwg` for the gated delta rule (g and w/dv given) in torch.

    q, k [B, T, H, K]; v (the chunk-corrected values), do, dv [B, T, HV, V]; g [B, T, HV] (fp32, log2 space,
    cumulative within each chunk); h, dh: one [K, V] state (or [V, K] with `state_v_first`) per chunk and value
    head, chunks in FLA's order; `cu_seqlens` packs several sequences in B = 1. Returns (dq, dk, dw, dg).
    """
    if g is None or w is None or dv is None or g_gamma is not None:
        raise NotImplementedError("this chunk_bwd_dqkwg covers the gated delta rule only (g, w and dv given)")
    batch, length, heads, d_k = k.shape
    v_heads, d_v = v.shape[2], v.shape[-1]
    scale = d_k ** -0.5 if scale is None else scale
    idx, valid, last = _chunks(batch, length, cu_seqlens, chunk_size, k.device, chunk_indices)
    n_chunks = idx.shape[0]
    f32 = torch.float32
    qc, kc, vc, doc, dvc = (_gather(x, idx, valid, v_heads) for x in (q, k, v, do, dv.to(v.dtype)))  # input dtype
    gc = (g.reshape(batch * length, v_heads)[idx] * valid[:, :, None]).transpose(1, 2)  # [n, HV, C]
    g_last = g.reshape(batch * length, v_heads)[last].to(f32)  # [n, HV]
    hc = h.reshape(n_chunks, v_heads, *h.shape[-2:])
    dhc = dh.reshape(n_chunks, v_heads, *dh.shape[-2:])
    if state_v_first:  # [V, K] states: the formulas below take [K, V]
        hc, dhc = hc.transpose(-1, -2), dhc.transpose(-1, -2)
    h16 = hc.to(do.dtype).transpose(-1, -2)  # [n, HV, V, K]: the kernel's h tile, rounded to do's dtype
    dh16 = dhc.to(v.dtype).transpose(-1, -2)

    dg_last = (hc.to(f32) * dhc.to(f32)).sum((-1, -2)) * torch.exp2(g_last)  # [n, HV]
    dq = _mm(doc, h16) * (torch.exp2(gc) * scale)[..., None]
    decay = torch.where(valid[:, None, :], torch.exp2(g_last[..., None] - gc), 0.0)
    dk = _mm(vc, dh16) * decay[..., None]
    dw = -_mm(dvc, hc.to(v.dtype).transpose(-1, -2))
    kf, qf = kc.to(f32), qc.to(f32)
    dg_last = dg_last + (dk * kf).sum((-1, -2))

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    mask = causal & valid[:, :, None] & valid[:, None, :]  # [n, C, C]
    ds = torch.where(mask[:, None], _mm(doc, vc.transpose(-1, -2)) * torch.exp2(gc[..., :, None] - gc[..., None, :]),
                     0.0) * scale
    ds = ds.to(k.dtype)  # rounded to the input dtype before its two matmuls, as the kernel does
    dq = dq + _mm(ds, kc)
    dk = dk + _mm(ds.transpose(-1, -2), qc)
    dg = (dq * qf).sum(-1) - (dk * kf).sum(-1)  # [n, HV, C]
    at_last = torch.arange(chunk_size, device=k.device) == (last - idx[:, 0])[:, None]  # [n, C]
    dg = dg + torch.where(at_last[:, None, :], dg_last[..., None], 0.0)

    shape = (batch, length, v_heads)
    dq, dk, dw = (_scatter(x, idx, valid, shape, dtype) for x, dtype in ((dq, q.dtype), (dk, q.dtype), (dw, w.dtype)))
    dg = _scatter(dg, idx, valid, shape, torch.float32)
    if heads != v_heads:  # the value heads sharing a key head add up
        dq = dq.view(batch, length, heads, v_heads // heads, d_k).sum(3)
        dk = dk.view(batch, length, heads, v_heads // heads, d_k).sum(3)
    return dq, dk, dw, dg


_OUT_DTYPE_GEMM: list[bool] = []  # [whether torch.bmm takes out_dtype for 16-bit CUDA operands], probed once


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 for operands of one dtype ([..., M, K] x [..., K, N], same leading dims). 16-bit operands on
    CUDA: one 16-bit GEMM accumulating in fp32 (`out_dtype`), the kernel's `tl.dot`; otherwise (CPU, fp32, a torch
    without `out_dtype`) the fp32 product of the same values, which differs only in summation order."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and b.dtype == a.dtype:
        if not _OUT_DTYPE_GEMM:
            try:
                torch.bmm(a.new_zeros(1, 1, 1), b.new_zeros(1, 1, 1), out_dtype=torch.float32)
                _OUT_DTYPE_GEMM.append(True)
            except (TypeError, RuntimeError, NotImplementedError):
                _OUT_DTYPE_GEMM.append(False)
        if _OUT_DTYPE_GEMM[0]:
            lead = a.shape[:-2]
            out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
            return out.reshape(*lead, *out.shape[-2:])
    return a.to(torch.float32) @ b.to(torch.float32)


def _gather(x, idx, valid, v_heads: int):
    """[B, T, heads, D] -> [n_chunks, HV, C, D], zero where a chunk runs past its sequence's end; key heads are
    repeated for the value heads that share them."""
    x = x.reshape(-1, *x.shape[2:])[idx] * valid[:, :, None, None]
    if x.shape[2] != v_heads:
        x = x.repeat_interleave(v_heads // x.shape[2], dim=2)
    return x.transpose(1, 2)


def _scatter(x, idx, valid, shape: tuple, dtype):
    """[n_chunks, HV, C, ...] -> [B, T, HV, ...] (`shape` = (B, T, HV)) at the valid positions, zero elsewhere.
    Rows past a sequence's end land on one extra row that is dropped: no mask indexing, so no device sync."""
    n_tokens = shape[0] * shape[1]
    rows = x.transpose(1, 2).flatten(0, 1)  # [n_chunks * C, HV, ...]
    out = torch.zeros(n_tokens + 1, *rows.shape[1:], dtype=dtype, device=x.device)
    out[torch.where(valid, idx, n_tokens).reshape(-1)] = rows.to(dtype)
    return out[:n_tokens].reshape(*shape, *rows.shape[2:])


def _chunks(batch: int, length: int, cu_seqlens, chunk_size: int, device, chunk_indices=None):
    """(idx [n, C], valid [n, C], last [n]): the flat token index of every chunk row in FLA's chunk order
    (sequence by sequence, then chunk by chunk), whether it lies inside its sequence, and each chunk's last
    valid token. Varlen: from FLA's `chunk_indices` ([n, 2]: sequence, chunk within it; what FLA's backward
    passes) without a device sync; from `cu_seqlens` alone the chunk count is read back from the device."""
    if cu_seqlens is None:
        per_seq = -(-length // chunk_size)
        starts = (torch.arange(batch, device=device)[:, None] * length
                  + torch.arange(per_seq, device=device)[None, :] * chunk_size).reshape(-1)
        ends = (torch.arange(batch, device=device) * length + length).repeat_interleave(per_seq)
    elif chunk_indices is not None:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        seq, within = chunk_indices.to(device=device, dtype=torch.long).unbind(1)
        starts = cu[seq] + within * chunk_size
        ends = cu[seq + 1]
    else:
        cu = cu_seqlens.to(device=device, dtype=torch.long)
        counts = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
        seq = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
        first = torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        starts = cu[seq] + (torch.arange(len(seq), device=device) - first) * chunk_size
        ends = cu[seq + 1]
    pos = starts[:, None] + torch.arange(chunk_size, device=device)[None, :]
    valid = pos < ends[:, None]
    return torch.where(valid, pos, 0), valid, torch.minimum(starts + chunk_size, ends) - 1
