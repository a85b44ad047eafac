"""Split tree attention (backend `flash_split`): a tree row's attention as two varlen calls merged by their
log-sum-exp, so a shared prefix is never copied once per descendant (docs/design.md §7.1).

A token of segment s attends (1) causally to its own segment and (2) to every token of its parent's path. Part (1) is
one causal varlen call over the row as it is (segments are contiguous ranges): nothing gathered. Part (2) groups the
segments by parent: the queries of all children of P (gathered) against path(P) (gathered once per parent, not once
per child). The partial softmaxes merge exactly: lse = logaddexp(lse1, lse2), out = out1 e^(lse1 - lse) +
out2 e^(lse2 - lse). The backward runs each call's flash backward with the MERGED output and lse: P = exp(S - lse)
is then the true probability restricted to that call's keys and D = rowsum(dout * out) the true one, so the two
calls' gradients add up to the exact gradient (the identity ring attention uses).

Against `flash_varlen`, which gathers every segment's whole path (K = N + the ancestors' lengths summed over
segments: 3.7 N for groups of 8 rollouts of a 1068-token prompt with 256-token completions), the keys read drop to
N + sum over parents of |path(P)| (1.3 N there), and so do the gather's scatter-add backward and the GQA head sum of
the flash backward. The FLOPs are the same.

Primitives: on CUDA torch's own FlashAttention ops (`aten::_flash_attention_forward/backward`, varlen, lse
[H, T_q] fp32); elsewhere a dense reference with the same contract (`reference_forward/backward`), which is what
the CPU tests run, so the split, the merge and the index plan are checked against the ancestor-mask attention
without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo.trie import PackedRow


# --------------------------------------------------------------------------------------------- primitives

def varlen_mask(cu_q: torch.Tensor, cu_k: torch.Tensor, causal: bool, window: int | None = None) -> torch.Tensor:
    """[T_q, T_k] bool: query i of sequence b sees the keys of b; causal: bottom-right aligned, as FlashAttention
    (query j of an Lq-query sequence over Lk keys sees keys 0 .. Lk - Lq + j), and with `window` only the last
    `window` of those."""
    cu_q, cu_k = cu_q.long(), cu_k.long()
    seqs = torch.arange(len(cu_q) - 1, device=cu_q.device)
    seg_q = torch.repeat_interleave(seqs, cu_q.diff())  # [T_q]
    seg_k = torch.repeat_interleave(seqs, cu_k.diff())  # [T_k]
    allowed = seg_q[:, None] == seg_k[None, :]
    if causal:
        q_off = torch.arange(len(seg_q), device=cu_q.device) - cu_q[seg_q]
        k_off = torch.arange(len(seg_k), device=cu_k.device) - cu_k[seg_k]
        limit = (cu_k.diff() - cu_q.diff())[seg_q] + q_off
        allowed = allowed & (k_off[None, :] <= limit[:, None])
        if window is not None:
            allowed = allowed & (k_off[None, :] > limit[:, None] - window)
    return allowed


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, Hkv, D] (or [1, Hkv, T, D]) with each KV head repeated for its group of `heads` query heads (dim 1)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _probs(q, k, cu_q, cu_k, causal, scale):
    """Scores -> (masked scores [H, T_q, T_k] in >= fp32, mask, compute dtype)."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    s = torch.einsum("qhd,khd->hqk", q.to(dtype), repeat_kv(k, q.shape[1]).to(dtype)) * scale
    allowed = varlen_mask(cu_q, cu_k, causal)
    return s.masked_fill(~allowed, float("-inf")), allowed, dtype


def reference_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """q [T_q, H, D], k/v [T_k, Hkv, D] -> (out [T_q, H, D], lse [H, T_q] fp32, aux): FlashAttention's varlen
    contract, computed densely; a query with no keys (a sequence of 0 keys) gets out 0 and lse +inf, as
    FlashAttention writes them."""
    s, allowed, dtype = _probs(q, k, cu_q, cu_k, causal, scale)
    lse = torch.logsumexp(s, dim=-1).masked_fill(~allowed.any(-1), float("inf"))  # [H, T_q]
    p = torch.exp(s - lse[..., None])
    out = torch.einsum("hqk,khd->qhd", p, repeat_kv(v, q.shape[1]).to(dtype))
    return out.to(q.dtype), lse, None


def reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux):
    """FlashAttention's backward from (dout, out, lse), computed densely; dk/dv summed over each KV head's group."""
    s, allowed, dtype = _probs(q, k, cu_q, cu_k, causal, scale)
    heads, kv_heads = q.shape[1], k.shape[1]
    p = torch.exp(s - lse.to(dtype)[..., None]).masked_fill(~allowed, 0.0)  # [H, T_q, T_k]
    dout_c = dout.to(dtype)
    dv = torch.einsum("hqk,qhd->khd", p, dout_c)
    dp = torch.einsum("qhd,khd->hqk", dout_c, repeat_kv(v, heads).to(dtype))
    delta = (dout_c * out.to(dtype)).sum(-1).transpose(0, 1)  # [H, T_q]
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", ds, repeat_kv(k, heads).to(dtype)) * scale
    dk = torch.einsum("hqk,qhd->khd", ds, q.to(dtype)) * scale
    group = heads // kv_heads
    dk = dk.reshape(dk.shape[0], kv_heads, group, -1).sum(2)
    dv = dv.reshape(dv.shape[0], kv_heads, group, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """torch's FlashAttention varlen forward (CUDA, fp16/bf16): (out, lse [H, T_q] fp32, aux for the backward)."""
    res = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False,
                                                  scale=scale)
    out, lse = res[0], res[1]
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise RuntimeError(f"flash_split: this torch's FlashAttention returned lse of shape {tuple(lse.shape)}, "
                           f"not [heads, tokens] = {(q.shape[1], q.shape[0])}; use --attn-backend flash_varlen")
    return out, lse, (res[2], res[3])


def flash_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux):
    dq, dk, dv = torch.ops.aten._flash_attention_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0,
                                                          causal, aux[0], aux[1], scale=scale)
    return dq, dk, dv


# --------------------------------------------------------------------------------------------- the split

@dataclass
class SplitPlan:
    """Index plan of one row on its device: part 1 = the row's segments, part 2 = children grouped by parent, or
    in place: the row's runs of segments with the same parent (`PackedRow.anc_in_place`)."""

    cu_q: torch.Tensor  # [S+1] int32, segment bounds
    max_q: int
    anc_q_index: torch.Tensor  # [Qa] long, packed positions of the queries of part 2, grouped by parent
    anc_cu_q: torch.Tensor  # [P+1] int32
    anc_kv_index: torch.Tensor  # [Ka] long, each parent's root-to-parent path
    anc_cu_k: torch.Tensor  # [P+1] int32
    anc_max_q: int
    anc_max_k: int
    flash: bool  # CUDA primitives, else the dense reference
    in_place: bool = False  # part 2 over the row's runs; anc_q_index is then the [N] bool mask of non-root tokens

    @classmethod
    def of(cls, row: PackedRow, flash: bool) -> SplitPlan:
        return cls(row.cu_seqlens_q, row.max_seqlen_q, row.anc_q_index, row.anc_cu_q, row.anc_kv_index,
                   row.anc_cu_k, row.anc_max_q, row.anc_max_k, flash, row.anc_in_place)

    @classmethod
    def of_tensors(cls, cu_q, anc_q_index, anc_cu_q, anc_kv_index, anc_cu_k, sizes, flash: bool) -> SplitPlan:
        """The plan from `plan_tensors`' tensors (sizes = [max_q, anc_max_q, anc_max_k, in_place], CPU)."""
        max_q, anc_max_q, anc_max_k, in_place = (int(x) for x in sizes.tolist())
        return cls(cu_q, max_q, anc_q_index, anc_cu_q, anc_kv_index, anc_cu_k, anc_max_q, anc_max_k, flash,
                   bool(in_place))

    @property
    def has_ancestors(self) -> bool:
        return self.anc_max_q > 0

    def ops(self):
        return (flash_forward, flash_backward) if self.flash else (reference_forward, reference_backward)


def _merge(out_a, lse_a, out_b, lse_b, index):
    """Fold part 2 (rows `index` of the row) into part 1: exact softmax merge by log-sum-exp."""
    la = lse_a.index_select(1, index)  # [H, Qa]
    lse_m = torch.logaddexp(la, lse_b)
    wa = torch.exp(la - lse_m).transpose(0, 1).unsqueeze(-1)  # [Qa, H, 1]
    wb = torch.exp(lse_b - lse_m).transpose(0, 1).unsqueeze(-1)
    merged = out_a.index_select(0, index).to(wa.dtype) * wa + out_b.to(wa.dtype) * wb
    return out_a.index_copy(0, index, merged.to(out_a.dtype)), lse_a.index_copy(1, index, lse_m)


def merge_in_place(out_a, lse_a, out_b, lse_b, has_parent):
    """Fold an in-place part 2 (every row of the row; keys only where `has_parent`) into part 1: the exact merge
    where a token has a parent, part 1 unchanged elsewhere (whatever part 2 wrote there: FlashAttention writes 0
    and lse +inf for a query without keys). The definition: on CUDA one Triton kernel computes it (`_merge_rows`)."""
    lse_b = torch.where(has_parent[None, :], lse_b, float("-inf"))
    lse_m = torch.logaddexp(lse_a, lse_b)  # == lse_a where there is no part 2
    wa = torch.exp(lse_a - lse_m).transpose(0, 1).unsqueeze(-1)  # [N, H, 1]
    wb = torch.exp(lse_b - lse_m).transpose(0, 1).unsqueeze(-1)
    out_b = torch.where(has_parent[:, None, None], out_b.to(wa.dtype), 0.0)
    return (out_a.to(wa.dtype) * wa + out_b * wb).to(out_a.dtype), lse_m


MERGE_KERNEL = "triton"
"""How CUDA runs `merge_in_place`: "triton" (grpo/kernels/split_merge.py, one kernel; 0.10 ms per layer on an H100 at a
15.6k-token Qwen3-1.7B row) or "compiled" (torch.compile of the definition, 0.49 ms there: its [H, N] lse operands
against [N, H, D] outputs; `scripts/bench_attention.py`). A bench switch flips it."""
_COMPILED_MERGE: list = []


def _merge_rows(out_a, lse_a, out_b, lse_b, has_parent):
    """`merge_in_place` on the row's device: one kernel on CUDA, the definition elsewhere (CPU; meta tensors)."""
    if out_a.device.type != "cuda":
        return merge_in_place(out_a, lse_a, out_b, lse_b, has_parent)
    if MERGE_KERNEL == "triton":
        from grpo.kernels.split_merge import merge_rows_triton

        return merge_rows_triton(out_a, lse_a, out_b, lse_b, has_parent)
    if not _COMPILED_MERGE:
        _COMPILED_MERGE.append(torch.compile(merge_in_place, dynamic=True))
    return _COMPILED_MERGE[0](out_a, lse_a, out_b, lse_b, has_parent)


def _split_forward(q, k, v, plan: SplitPlan, scale: float):
    """(out, lse, aux of part 1, aux of part 2 or None): part 1 over the row, part 2 per parent (or per run in
    place), merged."""
    fwd, _ = plan.ops()
    out, lse, aux = fwd(q, k, v, plan.cu_q, plan.cu_q, plan.max_q, plan.max_q, True, scale)
    aux_b = None
    if plan.has_ancestors:
        qb, kb, vb = _part2_inputs(plan, q, k, v)
        out_b, lse_b, aux_b = fwd(qb, kb, vb, plan.anc_cu_q, plan.anc_cu_k, plan.anc_max_q, plan.anc_max_k,
                                  False, scale)
        if plan.in_place:
            out, lse = _merge_rows(out, lse, out_b, lse_b, plan.anc_q_index)
        else:
            out, lse = _merge(out, lse, out_b, lse_b, plan.anc_q_index)
    return out, lse, aux, aux_b


def _split_backward(dout, q, k, v, out, lse, plan: SplitPlan, scale: float, aux, aux_b):
    """(dq, dk, dv): each call's backward with the MERGED out and lse, part 2's gradients added into place."""
    _, bwd = plan.ops()
    dout = dout.contiguous()
    dq, dk, dv = bwd(dout, q, k, v, out, lse, plan.cu_q, plan.cu_q, plan.max_q, plan.max_q, True, scale, aux)
    if plan.has_ancestors and plan.in_place:  # every row's query where it is: no gathers, a plain add for dq
        _, kb, vb = _part2_inputs(plan, q, k, v)
        dq_b, dk_b, dv_b = bwd(dout, q, kb, vb, out, lse, plan.anc_cu_q, plan.anc_cu_k, plan.anc_max_q,
                               plan.anc_max_k, False, scale, aux_b)
        dq.add_(dq_b.to(dq.dtype))  # 0 where a token has no parent
        dk.index_add_(0, plan.anc_kv_index, dk_b.to(dk.dtype))
        dv.index_add_(0, plan.anc_kv_index, dv_b.to(dv.dtype))
    elif plan.has_ancestors:
        index = plan.anc_q_index
        qb, kb, vb = _part2_inputs(plan, q, k, v)
        dq_b, dk_b, dv_b = bwd(dout.index_select(0, index), qb, kb, vb, out.index_select(0, index),
                               lse.index_select(1, index).contiguous(), plan.anc_cu_q, plan.anc_cu_k,
                               plan.anc_max_q, plan.anc_max_k, False, scale, aux_b)
        # in place: dq/dk/dv are the backward's own fresh tensors (no [N, H, D] copy each, per layer and step)
        dq.index_add_(0, index, dq_b.to(dq.dtype))  # each query once: no colliding adds
        dk.index_add_(0, plan.anc_kv_index, dk_b.to(dk.dtype))
        dv.index_add_(0, plan.anc_kv_index, dv_b.to(dv.dtype))
    return dq, dk, dv


class SplitAttention(torch.autograd.Function):
    """q [N, H, D], k/v [N, Hkv, D] of one tree row -> out [N, H, D], each token over its root-to-token path (the
    eager form; `split_attention_op` is the same computation as a custom op that torch.compile can keep inside a
    compiled layer)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: SplitPlan, scale: float):
        out, lse, aux, aux_b = _split_forward(q, k, v, plan, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.aux = plan, scale, (aux, aux_b)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return (*_split_backward(dout, q, k, v, out, lse, ctx.plan, ctx.scale, *ctx.aux), None, None)


def _part2_inputs(plan: SplitPlan, q, k, v):
    return (q if plan.in_place else q.index_select(0, plan.anc_q_index), k.index_select(0, plan.anc_kv_index),
            v.index_select(0, plan.anc_kv_index))


def split_attention(row: PackedRow, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    flash: bool) -> torch.Tensor:
    """[N, H, D] attention output of `row` (q [N, H, D], k/v [N, Hkv, D]) through the split formulation."""
    return SplitAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), SplitPlan.of(row, flash), scale)


# --------------------------------------------------------------------------------------------- as a custom op
# The same split as `SplitAttention`, registered as two torch.library custom ops (forward, backward) whose
# arguments are tensors only: a whole decoder layer compiled with torch.compile then calls it inside its graph
# (opaque, not traced) instead of breaking the graph around an eager attention call, and the layer's backward is one
# compiled graph too. The row's sizes (max_q, anc_max_q, anc_max_k, in_place) travel as a CPU int64 tensor, read
# inside the op: a Python int would become a guard of the compiled layer and recompile it for every new row.

def plan_tensors(row: PackedRow) -> tuple[torch.Tensor, ...]:
    """`row`'s split plan as the ops' tensor arguments: cu_q, anc_q_index, anc_cu_q, anc_kv_index, anc_cu_k (on the
    row's device) and sizes = [max_q, anc_max_q, anc_max_k, in_place] (CPU int64)."""
    sizes = torch.tensor([row.max_seqlen_q, row.anc_max_q, row.anc_max_k, int(row.anc_in_place)], dtype=torch.int64)
    plan = row.cu_seqlens_q, row.anc_q_index, row.anc_cu_q, row.anc_kv_index, row.anc_cu_k
    for t in plan:  # only the op reads their lengths: no 0/1 specialization (a row with a 1-token parent path, or
        torch._dynamo.decorators.mark_unbacked(t, 0)  # nothing shared, would otherwise compile the layer again)
    return (*plan, sizes)


def _no_dropout_aux(device: torch.device):
    """FlashAttention's (philox seed, offset) for a backward without dropout (unread there; torch's own varlen
    attention passes the same)."""
    return torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device)


@torch.library.custom_op("grpo::split_attention", mutates_args=())
def split_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                       anc_q_index: torch.Tensor, anc_cu_q: torch.Tensor, anc_kv_index: torch.Tensor,
                       anc_cu_k: torch.Tensor, sizes: torch.Tensor, scale: float,
                       flash: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [N, H, D], lse [H, N]) of the split attention; q [N, H, D], k/v [N, Hkv, D] contiguous."""
    plan = SplitPlan.of_tensors(cu_q, anc_q_index, anc_cu_q, anc_kv_index, anc_cu_k, sizes, flash)
    out, lse, _, _ = _split_forward(q, k, v, plan, scale)
    return out.contiguous(), lse.contiguous()


@split_attention_op.register_fake
def _split_attention_fake(q, k, v, cu_q, anc_q_index, anc_cu_q, anc_kv_index, anc_cu_k, sizes, scale, flash):
    lse_dtype = torch.float32 if flash else torch.promote_types(q.dtype, torch.float32)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype)


@torch.library.custom_op("grpo::split_attention_backward", mutates_args=())
def split_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                out: torch.Tensor, lse: torch.Tensor, cu_q: torch.Tensor, anc_q_index: torch.Tensor,
                                anc_cu_q: torch.Tensor, anc_kv_index: torch.Tensor, anc_cu_k: torch.Tensor,
                                sizes: torch.Tensor, scale: float,
                                flash: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `split_attention_op` from the output gradient and its saved out and lse."""
    plan = SplitPlan.of_tensors(cu_q, anc_q_index, anc_cu_q, anc_kv_index, anc_cu_k, sizes, flash)
    aux = _no_dropout_aux(q.device) if flash else None
    dq, dk, dv = _split_backward(dout, q, k, v, out, lse, plan, scale, aux, aux)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@split_attention_backward_op.register_fake
def _split_attention_backward_fake(dout, q, k, v, out, lse, cu_q, anc_q_index, anc_cu_q, anc_kv_index, anc_cu_k,
                                   sizes, scale, flash):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _op_setup(ctx, inputs, output):
    q, k, v, *plan, scale, flash = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], *plan)
    ctx.scale, ctx.flash = scale, flash


def _op_backward(ctx, dout, _dlse):
    q, k, v, out, lse, *plan = ctx.saved_tensors
    dq, dk, dv = split_attention_backward_op(dout, q, k, v, out, lse, *plan, ctx.scale, ctx.flash)
    return dq, dk, dv, *([None] * (len(plan) + 2))


split_attention_op.register_autograd(_op_backward, setup_context=_op_setup)


def split_attention_in_graph(plan: tuple[torch.Tensor, ...], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float, flash: bool) -> torch.Tensor:
    """`split_attention` through the custom op, `plan` from `plan_tensors`: what a compiled layer calls."""
    return split_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), *plan, scale, flash)[0]
