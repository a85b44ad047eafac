"""Tree-packed forward of Gated DeltaNet (GDN) layers: Qwen3.5 hybrids trained on prefix-trie rows.

A GDN layer scans along the sequence twice (docs/design.md §7.2): a short causal depthwise conv over the
projected q/k/v, then the gated delta-rule recurrence S_t = g_t S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T,
o_t = S_t q_t. In a packed trie a token's history is its path, not the packed positions before it, so:

- the conv reads the token's K_c - 1 path predecessors (`token_pred` chained, zero past the root; an [N, K_c]
  index table): one contiguous depthwise conv over the row (shifted row slices, no gather), with the few rows
  where the path is not the packed positions before it (segment starts) recomputed from the table
  (`tree_causal_conv1d`);
- the recurrence runs each segment (a unary chain, contiguous in the row) from its parent segment's final
  state, one batched call per level of the segment tree, so sequential launches = tree depth, not segment
  count. Autograd flows through the initial states, so a child's loss reaches its parent's chain.

Kernels of the recurrence (`gdn_kernels` in grpo/kernels/gdn_choice.py picks them per device, forward and backward judged
separately, and logs the choice once):

- `chunk_gated_delta_rule`, this project's torch kernel (grpo/kernels/gdn_kernel.py): 64-token chunks in the WY/UT form of
  the Gated DeltaNet paper (arXiv 2412.06464; FLA's chunk algorithm). Everything inside a chunk is batched matmuls
  over all chunks of all segments of a level at once; the only sequential work is one [D_k, D_k] x [D_k, D_v] matmul
  per chunk (`_ChunkScan`, which has a hand-written reverse scan as its backward; the rest is autograd). A level's
  segments are right-padded to a multiple of 64 past its longest one with g = 0, beta = 0, k = q = v = 0, which
  leaves the state unchanged, so final states are exact (padding costs compute, not correctness).
- `sequential_gated_delta_rule`: the token-by-token recurrence, the reference the chunked kernel is tested against.
- FLA's Triton kernels (`pip install fla-core`), no padding, in the directions `fla_directions` accepts on the
  running Triton/GPU (its gated chunk backward is wrong with Triton >= 3.4, < 3.7.1 on Hopper), through
  grpo/kernels/gdn_fla.py: its chunk pipeline once over the row with only its state kernels per level (`FlaTreeRule`,
  where this fla-core's internals are the known ones and it passed its check on the GPU), else FLA's public varlen
  `chunk_gated_delta_rule` once per level (a level's segments concatenated, one initial state per segment).

The torch path never calls transformers' `torch_chunk_gated_delta_rule`: transformers binds that name to FLA's
kernel whenever `fla` is importable, so `gdn_kernel=torch` would silently run FLA.

Departures from the unpacked layer, all exact up to fp rounding: chunk boundaries restart at every segment; the
padding above.

`patch_gdn_layers` is the one place this codebase wraps model code: transformers routes attention through
`AttentionInterface` (which `grpo/tree_attention.py` uses), but has no such interface for recurrent layers, so
the GDN modules' `forward` is wrapped per instance (transformers' files are not edited). The wrapper takes the
tree path only inside `grpo.tree_attention.forward_hidden` (its `tree_context` keyword, or `ACTIVE_ROW` holding
a row), and calls the original forward otherwise.
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F

from grpo.kernels.gdn_choice import (FLA_BAD_BACKWARD_TRITON, TRANSFORMERS_GDN_FUNCTIONS,  # noqa: F401 (re-exported)
                                     GdnKernels, choose_gdn_kernels, fla_directions, gdn_kernels, is_gdn_layer,
                                     transformers_torch_reference)
from grpo.kernels.gdn_fla import (fla_tree_kernels, level_major, row_order,  # noqa: F401 (re-exported)
                                  tree_fla_gated_delta_rule, tree_varlen_gated_delta_rule)
from grpo.kernels.gdn_formula import gdn_gates, l2norm_leading, tree_conv_formula  # noqa: F401 (re-exported)
from grpo.kernels.gdn_kernel import (CHUNK, chunk_gated_delta_rule, compile_chunk_regions,  # noqa: F401 (re-exported)
                                     sequential_gated_delta_rule, unit_lower_inverse)
from grpo.kernels.gdn_plan import (LevelPlan, TreeScanPlan, conv_fix_index,  # noqa: F401 (re-exported)
                                   conv_index_table, plan_tree_scan, row_plan, segment_levels)
from grpo.row_context import ACTIVE_ROW

log = logging.getLogger(__name__)


class _ContiguousDepthwiseConv(torch.autograd.Function):
    """out[n, c] = sum_i w[c, i] x[n - (K_c - 1 - i), c] (zero before row 0), accumulated in fp32 (or wider),
    returned in the weight dtype: K_c shifted multiply-adds over row slices, no gather or scatter. Autograd saves x
    and the weight only."""

    @staticmethod
    def forward(ctx, x, weight):  # x [N, C], weight [C, K_c]
        acc = torch.promote_types(weight.dtype, torch.float32)
        kernel_size = weight.shape[1]
        out = x.to(acc) * weight[:, -1].to(acc)  # [N, C], tap K_c - 1 reads the token itself
        for tap in range(kernel_size - 1):
            shift = kernel_size - 1 - tap
            out[shift:] += x[:-shift].to(acc) * weight[:, tap].to(acc)
        ctx.save_for_backward(x, weight)
        return out.to(weight.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [N, C]
        x, weight = ctx.saved_tensors
        acc = torch.promote_types(weight.dtype, torch.float32)
        kernel_size = weight.shape[1]
        grad = grad_out.to(acc)
        grad_x = grad * weight[:, -1].to(acc)  # [N, C]
        grad_weight = torch.empty(weight.shape, dtype=acc, device=weight.device)  # [C, K_c]
        grad_weight[:, -1] = (grad * x.to(acc)).sum(0)
        for tap in range(kernel_size - 1):
            shift = kernel_size - 1 - tap
            grad_x[:-shift] += grad[shift:] * weight[:, tap].to(acc)
            grad_weight[:, tap] = (grad[shift:] * x[:-shift].to(acc)).sum(0)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype)


def tree_causal_conv1d(mixed_qkv: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       activation: str | None, conv_index: torch.Tensor,
                       fix_index: torch.Tensor | None = None, qk_norm: tuple[int, int] | None = None) -> torch.Tensor:
    """Causal depthwise conv along each token's path: the packed-row twin of transformers' `causal_conv1d_fn`.

    The contiguous conv over the packed row (`_ContiguousDepthwiseConv`) is right for every token whose K_c - 1
    path predecessors are the packed positions just before it; the `fix_index` rows (`conv_fix_index`, a few per
    segment) are recomputed from their path windows and put in its place. Like transformers, the conv runs in the
    weight dtype, the activation follows, and the result returns in the input dtype. `qk_norm` = (channels,
    head_dim): the first `channels` outputs (query and key) are L2-normalised per head (`l2norm_leading`), the
    normalisation FLA's kernels otherwise launch per call (`use_qk_l2norm_in_kernel`), here fused into the conv.
    mixed_qkv [N, C], weight [C, K_c], conv_index [N, K_c] (N = a zero tap) -> [N, C].
    """
    from transformers.activations import ACT2FN

    n_tokens = conv_index.shape[0]
    if fix_index is None:
        fix_index = conv_fix_index(conv_index)
    if "conv" in _COMPILED and activation in _FORMULA_ACTIVATIONS:
        out = _COMPILED["conv"](mixed_qkv.to(weight.dtype), weight, bias, fix_index, conv_index[fix_index],
                                activation is not None, qk_norm)
        return out.to(mixed_qkv.dtype)
    x = mixed_qkv.to(weight.dtype)  # [N, C]
    out = _ContiguousDepthwiseConv.apply(x, weight)  # [N, C]
    if fix_index.numel():
        window = conv_index[fix_index]  # [M, K_c]
        taps = x[window.clamp(max=n_tokens - 1)] * (window < n_tokens)[..., None].to(x.dtype)  # [M, K_c, C]
        acc = torch.promote_types(weight.dtype, torch.float32)
        fixed = (taps.to(acc) * weight.t().to(acc)).sum(dim=1)  # [M, C]
        out = out.index_put((fix_index,), fixed.to(out.dtype))
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = ACT2FN[activation](out)
    return (out if qk_norm is None else l2norm_leading(out, *qk_norm)).to(mixed_qkv.dtype)


_FORMULA_ACTIVATIONS = (None, "silu", "swish")
_COMPILED: dict = {}  # "conv": torch.compile'd `tree_conv_formula`, "gates": `gdn_gates`, once `compile_tree_conv` ran


def compile_tree_conv(**compile_kwargs) -> None:
    """Route `tree_causal_conv1d` through the torch.compile'd `tree_conv_formula`, and the layer's gates through a
    compiled `gdn_gates` (dynamic shapes by default: rows change length). Eager, the conv is ~3 fp32 passes over
    [N, C] per tap forward and more backward, the gates seven kernels; fused, a few each. Idempotent."""
    compile_kwargs.setdefault("dynamic", True)
    for name, fn in (("conv", tree_conv_formula), ("gates", gdn_gates)):
        if name not in _COMPILED:
            _COMPILED[name] = torch.compile(fn, **compile_kwargs)


# ------------------------------------------------------------------------------------------------ tree drivers

def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 for an index of any shape, as `index_select`: its backward is one `index_add_`, where
    advanced indexing's (`index_put_` with accumulate) sorts the indices first on CUDA."""
    return x.index_select(0, index.reshape(-1)).view(*index.shape, *x.shape[1:])


def tree_chunk_gated_delta_rule(chunk_rule, query, key, value, g, beta, plan: TreeScanPlan) -> torch.Tensor:
    """A padded-batch gated delta rule over a segment tree, one `chunk_rule` call per level.

    query/key [N, H, D_k], value [N, H, D_v], g/beta [N, H] (heads already repeated to the value heads);
    returns [N, H, D_v]. `chunk_rule` has the signature of `chunk_gated_delta_rule` (this module's torch kernel in
    the trainer; `sequential_gated_delta_rule` or another padded kernel in tests).
    """
    padded = [F.pad(t, (0, 0) * (t.dim() - 1) + (0, 1)) for t in (query, key, value, g, beta)]  # zero row N
    outputs, final_states = [], None
    for level in plan.levels:
        q_l, k_l, v_l, g_l, beta_l = (_take(t, level.gather_index) for t in padded)  # [B, T, ...]
        initial_state = None if level.parent_slot is None else _take(final_states, level.parent_slot)  # [B, H, ..]
        out_l, final_states = chunk_rule(q_l, k_l, v_l, g=g_l, beta=beta_l, initial_state=initial_state,
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        outputs.append(_take(out_l.flatten(0, 1), level.valid_index))  # [n_level, H, D_v]
    return _take(torch.cat(outputs), plan.unpermute)  # [N, H, D_v]


def tree_gdn_forward(layer, hidden_states: torch.Tensor, plan: TreeScanPlan) -> torch.Tensor:
    """A Qwen3.5 GDN layer's forward on one packed row: hidden_states [1, N, hidden] -> [1, N, hidden].

    Mirrors `Qwen3_5GatedDeltaNet.forward` without cache, with the conv and the recurrence made tree-aware.
    """
    if hidden_states.shape[0] != 1:
        raise ValueError(f"tree-packed GDN expects one unpadded row (batch 1), got batch {hidden_states.shape[0]}")
    x = hidden_states.squeeze(0)  # [N, hidden]
    n_tokens = x.shape[0]
    kernels, fla_rule = gdn_kernels(getattr(layer, "_tree_gdn_kernel", "auto"), x.device,
                                    (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim))
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters()))
    fla = kernels.for_forward(needs_grad) == "fla"  # FLA: query/key normalised inside the conv, not by FLA per call
    ordered = fla and kernels.one_pass  # the layer runs in the row's level-major order, the recurrence's own
    if ordered:
        from grpo.kernels.gdn_graph import graph_gdn_forward

        out = graph_gdn_forward(layer, x, plan)  # the mixer as one compiled graph, where compile_scope says so
        if out is not None:
            return out[None]
        x = level_major(plan, x)
    conv_index, fix_index = ((plan.ordered_conv_index, plan.ordered_conv_fix_index) if ordered
                             else (plan.conv_index, plan.conv_fix_index))
    mixed_qkv = tree_causal_conv1d(layer.in_proj_qkv(x), layer.conv1d.weight.squeeze(1), layer.conv1d.bias,
                                   layer.activation, conv_index, fix_index,
                                   (2 * layer.key_dim, layer.head_k_dim) if fla else None)  # [N, 2 key + value]
    query, key, value = torch.split(mixed_qkv, [layer.key_dim, layer.key_dim, layer.value_dim], dim=-1)
    query = query.reshape(n_tokens, -1, layer.head_k_dim)  # [N, H_k, D_k]
    key = key.reshape(n_tokens, -1, layer.head_k_dim)  # [N, H_k, D_k]
    value = value.reshape(n_tokens, -1, layer.head_v_dim)  # [N, H_v, D_v]
    z = layer.in_proj_z(x).reshape(n_tokens, -1, layer.head_v_dim)  # [N, H_v, D_v]
    g, beta = _COMPILED.get("gates", gdn_gates)(layer.in_proj_a(x), layer.in_proj_b(x), layer.A_log,
                                                layer.dt_bias)  # [N, H_v] each
    if ordered:
        core_attn_out = tree_fla_gated_delta_rule(query, key, value, g, beta, plan, ordered=True)
    elif fla:
        core_attn_out = tree_varlen_gated_delta_rule(fla_rule, query, key, value, g, beta, plan,
                                                     use_qk_l2norm_in_kernel=False)
    else:
        if layer.num_v_heads // layer.num_k_heads > 1:
            query = query.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=1)
            key = key.repeat_interleave(layer.num_v_heads // layer.num_k_heads, dim=1)
        core_attn_out = tree_chunk_gated_delta_rule(chunk_gated_delta_rule, query, key, value, g, beta, plan)
    core_attn_out = layer.norm(core_attn_out.reshape(-1, layer.head_v_dim), z.reshape(-1, layer.head_v_dim))
    out = layer.out_proj(core_attn_out.reshape(n_tokens, -1))  # [N, hidden]
    return (row_order(plan, out) if ordered else out)[None]  # [1, N, hidden]


def patch_gdn_layers(model, kernel: str = "auto") -> int:
    """Wrap every GDN layer's `forward` so it runs tree-aware during a packed forward (`forward_hidden`).

    Works on text and VLM Qwen3.5 models (any module tree). Idempotent; returns the number of GDN layers.
    Outside a packed forward (no active row) the original forward runs unchanged, e.g. for generation.
    Models whose GDN modules have another layout (Qwen3-Next's fused in_proj_qkvz) are rejected by name.
    `kernel` picks the recurrence's kernels (`gdn_kernels`): auto | fla | torch.
    """
    plan_cache = _RowPlanCache()
    n_layers = 0
    for name, module in model.named_modules():
        if type(module).__name__.endswith("GatedDeltaNet") and not is_gdn_layer(module):
            raise NotImplementedError(f"{name}: {type(module).__name__} does not have Qwen3.5's GDN layout "
                                      "(in_proj_qkv/in_proj_z/in_proj_b/in_proj_a); add a tree forward for it")
        if not is_gdn_layer(module):
            continue
        n_layers += 1
        module._tree_gdn_kernel = kernel
        if getattr(module, "_tree_original_forward", None) is None:
            module._tree_original_forward = module.forward
            module._tree_plan_cache = plan_cache
            # a method of the shared function, not a per-layer partial: dynamo guards a partial by its id, so a decoder
            # layer compiled whole would compile once per GDN layer (past its recompile limit on Qwen3.5-2B)
            module.forward = types.MethodType(_tree_aware_forward, module)
    return n_layers


class _RowPlanCache:
    """The plan of the most recent row, for forwards that set only `ACTIVE_ROW` (no `tree_context` to cache in)."""

    def __init__(self):
        self.row = None
        self.kernel_size = None
        self.plan = None

    def get(self, row, kernel_size: int) -> TreeScanPlan:
        if row is not self.row or kernel_size != self.kernel_size:
            self.plan = row_plan(row, kernel_size)
            self.row, self.kernel_size = row, kernel_size
        return self.plan


def _active_row_and_plan(layer, plan_cache: _RowPlanCache, tree_context):
    """(row, plan) of the packed forward in progress, or (None, None) outside one.

    `tree_context` (grpo.tree_attention.TreeContext) arrives as a layer keyword, so it is also present when
    gradient checkpointing re-runs the layer during backward, after `ACTIVE_ROW` has been reset; its per-forward
    cache then holds the plan for every GDN layer.
    """
    if tree_context is None:
        row = ACTIVE_ROW.get(None)
        return (None, None) if row is None else (row, plan_cache.get(row, layer.conv_kernel_size))
    key = ("gdn_plan", layer.conv_kernel_size)
    if key not in tree_context.cache:
        row = tree_context.row
        tree_context.cache[key] = row_plan(row, layer.conv_kernel_size)
    return tree_context.row, tree_context.cache[key]


def _tree_aware_forward(layer, hidden_states, cache_params=None, attention_mask=None, **kwargs):
    tables = getattr(kwargs.get("tree_context"), "gdn_tables", None)
    if tables is not None and torch.compiler.is_compiling():  # inside a decoder layer compiled whole (layers_gdn)
        from grpo.kernels.gdn_graph import in_graph_forward

        out = in_graph_forward(layer, hidden_states, tables)
        if out is not None:
            return out
    row, plan = _active_row_and_plan(layer, layer._tree_plan_cache, kwargs.get("tree_context"))
    if row is None:
        return layer._tree_original_forward(hidden_states, cache_params=cache_params,
                                            attention_mask=attention_mask, **kwargs)
    if cache_params is not None:
        raise ValueError("tree-packed GDN forward does not use a cache: call the model with use_cache=False")
    if hidden_states.shape[:2] != (1, row.input_ids.shape[0]):
        raise ValueError(f"hidden states {tuple(hidden_states.shape)} do not match the active packed row of "
                         f"{row.input_ids.shape[0]} tokens: unpad the row and forward it as batch 1")
    return tree_gdn_forward(layer, hidden_states, plan)
