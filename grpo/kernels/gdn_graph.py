"""Gated DeltaNet layers on a trie row as compiled graphs (`compile_scope="layers_gdn"`).

With FLA's one-pass rule (grpo/kernels/gdn_fla.py) the eager tree forward of a GDN layer (grpo/kernels/gdn.py `tree_gdn_forward`)
makes three compiled calls (the tree conv, the gates, the gated norm) and about fifteen eager ops around FLA (four
input projections, the output projection, two permutations, splits), and the decoder layer three more compiled
calls (two norms, the MLP): each a trip through Python on the host, where the Qwen3.5 step's forward waited on the
host (docs/results.md). `mixer_formula` is the whole mixer as one function of tensors (weights and the row's tables
are arguments, nothing is a guarded constant but the head sizes), with the recurrence inside as a torch.library
custom op (`grpo::gdn_tree_rule` and its backward), opaque to the compiler, as `grpo::split_attention` is for
attention. A GDN decoder layer with a dense MLP is compiled whole around it (grpo/model.py `whole_gdn_layers`; its
mixer traced through `in_graph_forward` from the row's tables, `row_tables`, built before the decoder runs); the
mixer of any other GDN layer is compiled alone (`graph_gdn_forward`). The row's tables travel as tensors marked
unbacked (only the op reads their lengths), so a new row does not recompile.

On CUDA the op runs FLA's one-pass rule; elsewhere (the CPU tests) the token-by-token recurrence along each segment's
path, with the same contract.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo.kernels.gdn_formula import gdn_gates, tree_conv_formula
from grpo.kernels.gdn_fla import RulePlan, _Permute, fla_tree_kernels, rule_backward, rule_forward


def _rule_plan(seg_cu_seqlens, chunk_indices, chunk_offsets, parent_slots, level_segments) -> RulePlan:
    bounds = tuple(level_segments.tolist())  # a CPU tensor: no device read
    first = bounds[1] if len(bounds) > 1 else 0
    slots = [None] + [parent_slots[bounds[i] - first:bounds[i + 1] - first] for i in range(1, len(bounds) - 1)]
    return RulePlan(seg_cu_seqlens, chunk_indices, chunk_offsets, bounds, tuple(slots))


def _reference(q, k, v, g, beta, plan: RulePlan) -> torch.Tensor:
    """o [N, H_v, D_v]: the token-by-token recurrence per segment (grpo.kernels.gdn_kernel `sequential_gated_delta_rule`,
    fp32 or wider), each segment from its parent's final state."""
    from grpo.kernels.gdn_kernel import sequential_gated_delta_rule

    group = v.shape[1] // q.shape[1]
    q, k = (t.repeat_interleave(group, dim=1) for t in (q, k))
    bounds = plan.seg_cu_seqlens.tolist()
    outs, finals = [], None
    for first, stop, slots in plan.levels():
        h0 = None if slots is None else finals.index_select(0, slots)
        level_finals = []
        for i, seg in enumerate(range(first, stop)):
            lo, hi = bounds[seg], bounds[seg + 1]
            o, f = sequential_gated_delta_rule(*(t[None, lo:hi] for t in (q, k, v, g, beta)), output_final_state=True,
                                               initial_state=None if h0 is None else h0[i:i + 1])
            outs.append(o[0])
            level_finals.append(f)
        finals = torch.cat(level_finals)
    return torch.cat(outs).to(q.dtype)


@torch.library.custom_op("grpo::gdn_tree_rule", mutates_args=())
def gdn_tree_rule_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     seg_cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, chunk_offsets: torch.Tensor,
                     parent_slots: torch.Tensor,
                     level_segments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o [N, H_v, D_v] in q's dtype, g_cum [N, H_v] fp32, a_inv [N, H_v, 64], starts [S - B_0, H_v, D_k, D_v]
    fp32) of the gated delta rule over a row in level-major order: q/k [N, H_k, D_k] (normalised), v [N, H_v, D_v],
    g [N, H_v] fp32 log decay, beta [N, H_v]; the tables as grpo.kernels.gdn.TreeScanPlan holds them (level_segments on the
    CPU). g_cum, a_inv and starts are what the backward reads (zeros off CUDA, where it recomputes)."""
    plan = _rule_plan(seg_cu_seqlens, chunk_indices, chunk_offsets, parent_slots, level_segments)
    if q.is_cuda:
        o, g_cum, a_inv, starts = rule_forward(q[None], k[None], v[None], g[None], beta[None], plan,
                                               fla_tree_kernels())
        return o[0], g_cum[0], a_inv[0], (torch.cat(starts) if starts else _no_starts(q, v))
    o = _reference(q, k, v, g, beta, plan)
    n, heads = v.shape[:2]
    return (o, g.new_zeros(n, heads, dtype=torch.float32), k.new_zeros(n, heads, 64),
            q.new_zeros(parent_slots.shape[0], heads, q.shape[2], v.shape[2], dtype=torch.float32))


def _no_starts(q, v):
    return q.new_zeros(0, v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)


@gdn_tree_rule_op.register_fake
def _gdn_tree_rule_fake(q, k, v, g, beta, seg_cu_seqlens, chunk_indices, chunk_offsets, parent_slots, level_segments):
    n, heads = v.shape[:2]
    return (q.new_empty(n, heads, v.shape[2]), g.new_empty(n, heads, dtype=torch.float32), k.new_empty(n, heads, 64),
            q.new_empty(parent_slots.shape[0], heads, q.shape[2], v.shape[2], dtype=torch.float32))


@torch.library.custom_op("grpo::gdn_tree_rule_backward", mutates_args=())
def gdn_tree_rule_backward_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, g_cum: torch.Tensor, a_inv: torch.Tensor, starts: torch.Tensor,
                              seg_cu_seqlens: torch.Tensor, chunk_indices: torch.Tensor, chunk_offsets: torch.Tensor,
                              parent_slots: torch.Tensor, level_segments: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta) of `gdn_tree_rule_op` from its output gradient do [N, H_v, D_v]."""
    plan = _rule_plan(seg_cu_seqlens, chunk_indices, chunk_offsets, parent_slots, level_segments)
    if q.is_cuda:
        sizes = [stop - first for first, stop, slots in plan.levels() if slots is not None]
        grads = rule_backward(do[None], q[None], k[None], v[None], g_cum[None], beta[None], a_inv[None],
                              list(starts.split(sizes)), plan, fla_tree_kernels())
        return tuple(t[0].to(x.dtype) for t, x in zip(grads, (q, k, v, g, beta)))
    _, vjp = torch.func.vjp(lambda *xs: _reference(*xs, plan), q, k, v, g, beta)  # autograd is off in here
    return tuple(t.contiguous() for t in vjp(do))


@gdn_tree_rule_backward_op.register_fake
def _gdn_tree_rule_backward_fake(do, q, k, v, g, beta, g_cum, a_inv, starts, *tables):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape), \
        beta.new_empty(beta.shape)


def _op_setup(ctx, inputs, output):
    q, k, v, g, beta, *tables = inputs
    ctx.save_for_backward(q, k, v, g, beta, *output[1:], *tables)


def _op_backward(ctx, do, _dg_cum, _da_inv, _dstarts):
    q, k, v, g, beta, g_cum, a_inv, starts, *tables = ctx.saved_tensors
    grads = gdn_tree_rule_backward_op(do.contiguous(), q, k, v, g, beta, g_cum, a_inv, starts, *tables)
    return (*grads, *([None] * len(tables)))


gdn_tree_rule_op.register_autograd(_op_backward, setup_context=_op_setup)


# --------------------------------------------------------------------------------------------- the mixer

def mixer_weights(layer) -> tuple | None:
    """The GDN layer's weights as `mixer_formula` takes them, or None where the formula does not cover the layer
    (adapters or biases on its projections, another norm or activation): the eager forward runs it then."""
    linears = (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_a, layer.in_proj_b, layer.out_proj)
    if any(type(m) is not torch.nn.Linear or m.bias is not None for m in linears):
        return None
    norm = layer.norm
    if (not type(norm).__name__.endswith("RMSNormGated") or getattr(norm, "activation", "silu") not in ("silu", "swish")
            or layer.activation not in ("silu", "swish")):
        return None
    return (layer.in_proj_qkv.weight, layer.in_proj_z.weight, layer.in_proj_a.weight, layer.in_proj_b.weight,
            layer.conv1d.weight.squeeze(1), layer.conv1d.bias, layer.A_log, layer.dt_bias, norm.weight,
            layer.out_proj.weight)


def mixer_tables(plan) -> tuple:
    """The row's tables as `mixer_formula` takes them (from a grpo.kernels.gdn.TreeScanPlan on the row's device), their
    lengths marked unbacked so that a new row does not recompile the graph. The conv's recomputed rows are never
    none: inductor's 2-D Triton kernels over an unbacked length divide by zero at launch when it is 0 (torch 2.11,
    seen on an H200 with a plain row)."""
    fix_index, fix_window = plan.ordered_conv_fix_index, plan.ordered_fix_window
    if fix_index.numel() == 0:  # no segment continues a parent: recompute token 0 from its own window (the same value)
        fix_index, fix_window = fix_index.new_zeros(1), plan.ordered_conv_index[:1].clone()
    tables = (fix_index, fix_window, plan.seg_cu_seqlens, plan.chunk_indices, plan.chunk_offsets, plan.parent_slots,
              torch.tensor(plan.level_segments, dtype=torch.long))
    for t in tables:
        torch._dynamo.decorators.mark_unbacked(t, 0)
    return (plan.order, plan.unpermute, *tables)


def mixer_formula(x, weights: tuple, tables: tuple, heads: tuple[int, int, int, int], eps: float,
                  permute: bool) -> torch.Tensor:
    """A Qwen3.5 GDN layer's mixer on a trie row, as `tree_gdn_forward` computes it with FLA's one-pass rule:
    x [N, hidden] in the row's order -> [N, hidden]. `heads` = (H_k, H_v, D_k, D_v); `permute`: the row is not in
    level-major order (the mixer runs in that order and puts its output back)."""
    qkv_w, z_w, a_w, b_w, conv_w, conv_b, a_log, dt_bias, norm_w, out_w = weights
    order, unpermute, fix_index, fix_window, *rule_tables = tables
    h_k, h_v, d_k, d_v = heads
    if permute:
        x = _Permute.apply(x, order, unpermute)
    n = x.shape[0]
    qkv = F.linear(x, qkv_w)
    mixed = tree_conv_formula(qkv.to(conv_w.dtype), conv_w, conv_b, fix_index, fix_window, True,
                              (2 * h_k * d_k, d_k)).to(qkv.dtype)  # [N, 2 key + value], q and k normalised
    q, k, v = torch.split(mixed, [h_k * d_k, h_k * d_k, h_v * d_v], dim=-1)
    g, beta = gdn_gates(F.linear(x, a_w), F.linear(x, b_w), a_log, dt_bias)  # [N, H_v] each
    o = gdn_tree_rule_op(q.reshape(n, h_k, d_k).contiguous(), k.reshape(n, h_k, d_k).contiguous(),
                         v.reshape(n, h_v, d_v).contiguous(), g.contiguous(), beta.contiguous(), *rule_tables)[0]
    z = F.linear(x, z_w).reshape(n * h_v, d_v)
    o = o.reshape(n * h_v, d_v)
    normed = o.float() * torch.rsqrt(o.float().pow(2).mean(-1, keepdim=True) + eps)  # transformers' RMSNormGated
    o = ((norm_w * normed.to(o.dtype)) * F.silu(z.float())).to(o.dtype)
    out = F.linear(o.reshape(n, h_v * d_v), out_w)  # [N, hidden]
    return _Permute.apply(out, unpermute, order) if permute else out


_COMPILED: dict = {}


def compile_gdn_mixer(**compile_kwargs) -> None:
    """Run one-pass GDN mixers as the torch.compile'd `mixer_formula` (grpo/kernels/gdn.py `tree_gdn_forward`). Idempotent."""
    compile_kwargs.setdefault("dynamic", True)
    if "mixer" not in _COMPILED:
        _COMPILED["mixer"] = torch.compile(mixer_formula, **compile_kwargs)


def graph_gdn_forward(layer, x: torch.Tensor, plan) -> torch.Tensor | None:
    """The compiled mixer on x [N, hidden] (row order), or None where it is off or does not cover `layer`."""
    mixer = _COMPILED.get("mixer")
    weights = mixer_weights(layer) if mixer is not None else None
    if weights is None:
        return None
    heads = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    return mixer(x, weights, mixer_tables(plan), heads, float(layer.norm.variance_epsilon), not plan.level_major)


def row_tables(tree_context, kernel_size: int) -> tuple:
    """(`mixer_tables`, permute) of the packed row of `tree_context` (grpo.tree_attention.TreeContext), built before
    the decoder runs so that decoder layers compiled whole only read tensors; the plan is cached on the context for
    the GDN layers that run eagerly."""
    from grpo.kernels.gdn_plan import row_plan

    key = ("gdn_plan", kernel_size)
    if key not in tree_context.cache:
        tree_context.cache[key] = row_plan(tree_context.row, kernel_size)
    plan = tree_context.cache[key]
    return mixer_tables(plan), not plan.level_major


def in_graph_forward(layer, hidden_states: torch.Tensor, tables: tuple) -> torch.Tensor | None:
    """The GDN layer's mixer traced into its compiled decoder layer: hidden_states [1, N, hidden] -> [1, N, hidden];
    None where the formula does not cover the layer."""
    weights = mixer_weights(layer)
    if weights is None:
        return None
    heads = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    return mixer_formula(hidden_states[0], weights, tables[0], heads, float(layer.norm.variance_epsilon),
                         tables[1])[None]
