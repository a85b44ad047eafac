"""FLA's Gated DeltaNet kernels over a prefix-trie row (grpo/kernels/gdn.py's tree forward calls them when FLA runs).

In a trie row each segment starts from its parent segment's final state, so the recurrence has one sequential
dependency per trie level. Two drivers, both over the row put in level-major order (`_Permute`, skipped when the
row is in that order already):

- `tree_fla_gated_delta_rule` (the default, `FlaTreeRule`): FLA's chunk pipeline once over the whole row, every
  segment of every level a varlen sequence of one call. Of FLA's gated chunk algorithm only the state kernels read
  across chunks: the forward's (each chunk's starting state, from the previous one) and the backward's (each
  chunk's state gradient, from the next one). Those two are launched once per level, over that level's segments,
  each segment starting from its parent's final state (forward) and its children's initial-state gradients summed
  into its final-state gradient (backward). Every other kernel (gate cumsum, the WY representation, outputs, the
  local value gradient, dq/dk/dw/dg, the WY backward) runs once for the row: per layer, each level past the first
  costs three kernel launches (the forward state kernel, its recompute in the backward, the backward state kernel)
  instead of FLA's whole call (12 launches forward and backward with fla-core 0.6, and its Python around them; on
  an H200 the host's time for those calls, not the GPU's, bounded the Qwen3.5 tree step's forward).
- `tree_varlen_gated_delta_rule`: FLA's public `chunk_gated_delta_rule` once per level (or any kernel with its
  varlen signature): what runs where this fla-core's internals differ from the ones `fla_tree_kernels` knows.

Both take query and key already L2-normalised (grpo/kernels/gdn.py normalises them in the tree conv) and the gates as the
layer computes them: g = log decay (fp32), beta = sigmoid; scale = D_k^-0.5, as FLA's default.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

CHUNK = 64  # FLA's chunk size for the gated delta rule (its kernels' BT)

_FWD_H_ARGS = ["k", "v", "w", "v_new", "g", "gk", "h", "h0", "ht", "cu_seqlens", "chunk_offsets", "T", "H", "HV",
               "K", "V", "BT", "BV", "USE_G", "USE_GK", "USE_INITIAL_STATE", "STORE_FINAL_STATE", "SAVE_NEW_VALUE",
               "STATE_V_FIRST", "IS_VARLEN"]
_BWD_DHU_ARGS = ["q", "k", "w", "g", "gk", "dht", "dh0", "do", "dh", "dv", "dv2", "cu_seqlens", "chunk_offsets",
                 "scale", "T", "H", "HV", "K", "V", "BT", "BV", "USE_G", "USE_GK", "USE_INITIAL_STATE",
                 "USE_FINAL_STATE_GRADIENT", "STATE_V_FIRST", "IS_VARLEN"]
"""The two state kernels' arguments as fla-core 0.6 declares them: launched here directly (per level, into buffers
for the whole row), so a release that changes them is detected (`fla_tree_kernels` is None) rather than
mis-launched."""


@functools.cache
def fla_tree_kernels() -> SimpleNamespace | None:
    """FLA's pieces `FlaTreeRule` composes, or None when fla-core is absent or its internals differ from the ones
    this module was written against (fla-core 0.6): the callers then run FLA's public kernel per level."""
    try:
        from fla.ops.common.chunk_delta_h import (chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64,
                                                  chunk_gated_delta_rule_fwd_kernel_h_blockdim64)
        from fla.ops.common.chunk_o import chunk_bwd_dv_local, chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.gated_delta_rule.wy_fast import prepare_wy_repr_bwd, recompute_w_u_fwd
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except ImportError:
        return None
    fwd_h, bwd_dhu = chunk_gated_delta_rule_fwd_kernel_h_blockdim64, chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64
    for kernel, expected in ((fwd_h, _FWD_H_ARGS), (bwd_dhu, _BWD_DHU_ARGS)):
        if list(getattr(kernel, "arg_names", [])) != expected:
            return None
    return SimpleNamespace(fwd_h=fwd_h, bwd_dhu=bwd_dhu, cumsum=chunk_local_cumsum,
                           fwd_intra=chunk_gated_delta_rule_fwd_intra, fwd_o=chunk_fwd_o,
                           bwd_dv_local=chunk_bwd_dv_local, recompute_w_u=recompute_w_u_fwd,
                           wy_bwd=prepare_wy_repr_bwd, rcp_ln2=RCP_LN2)


def _dqkwg():
    """The dq/dk/dw/dg step FLA's gated backward calls now: FLA's own, or the one grpo/kernels/gdn_choice.py put in its place
    (past FLA's Triton guard, or in torch) after checking it on this GPU."""
    import fla.ops.gated_delta_rule.chunk as fla_chunk

    return fla_chunk.chunk_bwd_dqkwg


@dataclass(frozen=True)
class RulePlan:
    """What the one-pass rule reads of a row's plan: the level-major segment bounds and FLA's chunk tables (on the
    row's device), each level's first segment (then S), and each level's parent slots (None for the roots)."""

    seg_cu_seqlens: torch.Tensor  # [S + 1] long
    chunk_indices: torch.Tensor  # [NT, 2] long
    chunk_offsets: torch.Tensor  # [S + 1] long
    level_segments: tuple[int, ...]
    parent_slots: tuple[torch.Tensor | None, ...]  # per level: [B_l] slot of each segment's parent in level l - 1

    @classmethod
    def of(cls, plan) -> RulePlan:
        """From a grpo.kernels.gdn.TreeScanPlan."""
        return cls(plan.seg_cu_seqlens, plan.chunk_indices, plan.chunk_offsets, plan.level_segments,
                   tuple(level.parent_slot for level in plan.levels))

    def levels(self) -> list[tuple[int, int, torch.Tensor | None]]:
        """(first segment, stop segment, parent slots or None) of each level, in the level-major segment order."""
        bounds = self.level_segments
        return [(bounds[i], bounds[i + 1], slots) for i, slots in enumerate(self.parent_slots)]


def _grid(n_segments: int, heads: int, d_v: int):
    import triton

    return lambda meta: (triton.cdiv(d_v, meta["BV"]) * n_segments * heads,)


def _tree_states(fla, k, w, u, g, plan, initial_states=None):
    """(h [1, NT, H_v, D_k, D_v]: each chunk's starting state, v_new [1, N, H_v, D_v], the initial states of levels
    1.. [B_l, H_v, D_k, D_v] fp32): FLA's forward state kernel once per level over that level's segments, each
    from its parent's final state; with `initial_states` (the backward's recompute) those are read, not rebuilt."""
    _, n_tokens, heads_k, d_k = k.shape
    heads, d_v = u.shape[2], u.shape[3]
    h = k.new_empty(1, plan.chunk_indices.shape[0], heads, d_k, d_v)
    v_new = torch.empty_like(u)
    levels = plan.levels()
    starts, finals = [], None
    for depth, (first, stop, parent_slot) in enumerate(levels):
        h0 = None
        if depth:
            h0 = initial_states[depth - 1] if initial_states is not None else finals.index_select(0, parent_slot)
            starts.append(h0)
        last = depth == len(levels) - 1 or initial_states is not None
        finals = None if last else k.new_empty(stop - first, heads, d_k, d_v, dtype=torch.float32)
        fla.fwd_h[_grid(stop - first, heads, d_v)](
            k=k, v=u, w=w, v_new=v_new, g=g, gk=None, h=h, h0=h0, ht=finals,
            cu_seqlens=plan.seg_cu_seqlens[first:stop + 1], chunk_offsets=plan.chunk_offsets[first:stop + 1],
            T=n_tokens, H=heads_k, HV=heads, K=d_k, V=d_v, BT=CHUNK, STATE_V_FIRST=False)
    return h, v_new, starts


def _tree_state_grads(fla, q, k, w, g, do, dv, scale: float, plan):
    """(dh [1, NT, H_v, D_k, D_v], dv [1, N, H_v, D_v]): FLA's backward state kernel once per level, deepest first,
    each segment's final-state gradient the sum of its children's initial-state gradients."""
    _, n_tokens, heads_k, d_k = q.shape
    heads, d_v = do.shape[2], do.shape[3]
    dh = q.new_empty(1, plan.chunk_indices.shape[0], heads, d_k, d_v)
    dv_out = torch.empty_like(dv)
    levels = plan.levels()
    dht = None
    for depth in reversed(range(len(levels))):
        first, stop, parent_slot = levels[depth]
        dh0 = q.new_empty(stop - first, heads, d_k, d_v, dtype=torch.float32) if depth else None
        fla.bwd_dhu[_grid(stop - first, heads, d_v)](
            q=q, k=k, w=w, g=g, gk=None, dht=dht, dh0=dh0, do=do, dh=dh, dv=dv, dv2=dv_out,
            cu_seqlens=plan.seg_cu_seqlens[first:stop + 1], chunk_offsets=plan.chunk_offsets[first:stop + 1],
            scale=scale, T=n_tokens, H=heads_k, HV=heads, K=d_k, V=d_v, BT=CHUNK, STATE_V_FIRST=False)
        if depth:
            parent_first, parent_stop, _ = levels[depth - 1]
            dht = dh0.new_zeros(parent_stop - parent_first, heads, d_k, d_v).index_add_(0, parent_slot, dh0)
    return dh, dv_out


def _on_device(fn):
    """Run `fn` with its first tensor's CUDA device current (as FLA's `input_guard` does): Triton launches on the
    current device."""
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        if not args[0].is_cuda:
            return fn(*args, **kwargs)
        with torch.cuda.device(args[0].device):
            return fn(*args, **kwargs)

    return guarded


@_on_device
def rule_forward(q, k, v, g, beta, plan: RulePlan, fla):
    """(o [1, N, H_v, D_v] in q's dtype, what `rule_backward` reads: g_cum, a_inv, starts): FLA's gated chunk
    pipeline once over the row, its forward state kernel per level. Arguments as `FlaTreeRule`'s."""
    scale = k.shape[-1] ** -0.5
    seqs = dict(cu_seqlens=plan.seg_cu_seqlens, chunk_indices=plan.chunk_indices)
    g_cum = fla.cumsum(g, chunk_size=CHUNK, scale=fla.rcp_ln2, **seqs)  # log2 decays, as FLA's kernels read them
    w, u, a_inv = fla.fwd_intra(k=k, v=v, g=g_cum, beta=beta, chunk_size=CHUNK, **seqs)
    h, v_new, starts = _tree_states(fla, k, w, u, g_cum, plan)
    o = fla.fwd_o(q=q, k=k, v=v_new, h=h, g=g_cum, scale=scale, chunk_size=CHUNK, **seqs)
    return o.to(q.dtype), g_cum, a_inv, starts


@_on_device
def rule_backward(do, q, k, v, g_cum, beta, a_inv, starts, plan: RulePlan, fla):
    """(dq, dk, dv, dg (fp32), dbeta) of `rule_forward` from the output gradient do [1, N, H_v, D_v]."""
    scale = k.shape[-1] ** -0.5
    seqs = dict(cu_seqlens=plan.seg_cu_seqlens, chunk_indices=plan.chunk_indices)
    do = do.contiguous()
    w, u = fla.recompute_w_u(k=k, v=v, beta=beta, A=a_inv, g=g_cum, **seqs)
    h, v_new, _ = _tree_states(fla, k, w, u, g_cum, plan, starts)
    dv = fla.bwd_dv_local(q=q, k=k, g=g_cum, do=do, scale=scale, chunk_size=CHUNK, **seqs)
    dh, dv = _tree_state_grads(fla, q, k, w, g_cum, do, dv, scale, plan)
    dq, dk, dw, dg = _dqkwg()(q=q, k=k, v=v_new, w=w, g=g_cum, h=h, dv=dv, do=do, dh=dh, scale=scale,
                              chunk_size=CHUNK, **seqs)
    dk2, dv, dbeta, dg2 = fla.wy_bwd(k=k, v=v, beta=beta, A=a_inv, dw=dw, du=dv, g=g_cum, **seqs)
    dk.add_(dk2)
    dg.add_(dg2)
    dg = fla.cumsum(dg, chunk_size=CHUNK, reverse=True, **seqs)
    return dq.to(q), dk.to(k), dv.to(v), dg, dbeta.to(beta)


class FlaTreeRule(torch.autograd.Function):
    """The gated delta rule over a trie row in level-major order, FLA's chunk pipeline once for the row and its
    state kernels once per level (module docstring). q/k [1, N, H_k, D_k] (normalised), v [1, N, H_v, D_v],
    g [1, N, H_v] fp32 log decay, beta [1, N, H_v] -> o [1, N, H_v, D_v] in q's dtype."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, plan: RulePlan, fla):
        o, g_cum, a_inv, starts = rule_forward(q, k, v, g, beta, plan, fla)
        ctx.save_for_backward(q, k, v, g_cum, beta, a_inv, *starts)
        ctx.plan, ctx.fla, ctx.g_dtype = plan, fla, g.dtype
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, g_cum, beta, a_inv, *starts = ctx.saved_tensors
        dq, dk, dv, dg, dbeta = rule_backward(do, q, k, v, g_cum, beta, a_inv, starts, ctx.plan, ctx.fla)
        return dq, dk, dv, dg.to(ctx.g_dtype), dbeta, None, None


class _Permute(torch.autograd.Function):
    """x[perm] along dim 0 for a permutation `perm` of x's rows, whose backward is the gather by its inverse: no
    zero-filled gradient, no `index_add_` (index_select's backward: a scatter with atomic adds, which took 23 ms of
    a Qwen3.5-2B tree step's backward on an H200, 2026-12-04)."""

    @staticmethod
    def forward(ctx, x, perm, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def level_major(plan, x: torch.Tensor) -> torch.Tensor:
    """x [N, ...] in the row's order -> in its level-major order (`plan`: a grpo.kernels.gdn.TreeScanPlan)."""
    return x if plan.level_major else _Permute.apply(x, plan.order, plan.unpermute)


def row_order(plan, x: torch.Tensor) -> torch.Tensor:
    """x [N, ...] in the row's level-major order -> in the row's order (`level_major`'s inverse)."""
    return x if plan.level_major else _Permute.apply(x, plan.unpermute, plan.order)


def tree_fla_gated_delta_rule(query, key, value, g, beta, plan, fla=None, ordered: bool = False) -> torch.Tensor:
    """The recurrence over a trie row through `FlaTreeRule` (`fla`: `fla_tree_kernels()` unless given).

    query/key [N, H_k, D_k] (L2-normalised), value [N, H_v, D_v], g/beta [N, H_v] in the row's order, or in its
    level-major order with `ordered` (grpo/kernels/gdn.py runs a whole layer in that order: two permutations per layer, not
    six); returns [N, H_v, D_v] in the same order."""
    fla = fla if fla is not None else fla_tree_kernels()
    inputs = [query, key, value, g, beta] if ordered else [level_major(plan, t) for t in (query, key, value, g, beta)]
    out = FlaTreeRule.apply(*(t.contiguous()[None] for t in inputs), RulePlan.of(plan), fla).squeeze(0)
    return out if ordered else row_order(plan, out)


def tree_varlen_gated_delta_rule(varlen_rule, query, key, value, g, beta, plan,
                                 use_qk_l2norm_in_kernel: bool = True) -> torch.Tensor:
    """The same recurrence through a varlen kernel (FLA's `chunk_gated_delta_rule` with `cu_seqlens` and one
    initial state per segment): one call per level, no padding, grouped q/k heads passed as they are. The inputs are
    put in level-major order once (each level then a slice) and the output back in the row's, both as permutations.

    query/key [N, H_k, D_k], value [N, H_v, D_v], g/beta [N, H_v]; returns [N, H_v, D_v]. `use_qk_l2norm_in_kernel`
    False: query and key come normalised (the tree conv's `qk_norm`), so the kernel does not launch its own.
    """
    inputs = [level_major(plan, t) for t in (query, key, value, g, beta)]
    outputs, final_states, start = [], None, 0
    for level in plan.levels:
        stop = start + int(level.cu_seqlens_cpu[-1])
        q_l, k_l, v_l, g_l, beta_l = (t[start:stop].contiguous()[None] for t in inputs)  # a copy only for views
        initial_state = None if level.parent_slot is None else final_states.index_select(0, level.parent_slot)
        out_l, final_states = varlen_rule(q_l, k_l, v_l, g=g_l, beta=beta_l, initial_state=initial_state,
                                          output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                          cu_seqlens=level.cu_seqlens, cu_seqlens_cpu=level.cu_seqlens_cpu)
        outputs.append(out_l.squeeze(0))  # [n_level, H, D_v] (squeeze: a view backward, not a zero-fill + copy)
        start = stop
    return row_order(plan, outputs[0] if len(outputs) == 1 else torch.cat(outputs))  # [N, H, D_v]
