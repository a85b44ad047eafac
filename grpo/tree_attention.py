"""Tree attention: run a `PackedRow` through an unmodified Hugging Face decoder (docs/design.md §7.1).

We register one attention function, `grpo_tree`, through transformers' `AttentionInterface` and switch the text
decoder to it. The decoder is called with input_ids [1, N] and position_ids [1, N] (= trie depth, so RoPE sees
each token at its position in every sample through it), plus a `tree_context` keyword that transformers forwards
untouched to every attention call. Because the context travels as a keyword argument (not only a global), it
survives gradient checkpointing, which re-runs layers during backward outside this function's dynamic extent.
With no `tree_context` the function falls back to transformers' SDPA (with its own causal and window mask
and explicit scores for a soft-capped layer), so ordinary forwards keep working.

Backends (same math, three formulations):
- "flash_varlen": gather each segment's root-to-segment path K/V (kv_index) and call varlen causal attention
  with bottom-right alignment: torch's `varlen_attn(..., window_size=(-1, 0))`, or the `kernels` flash-attn
  varlen kernel when torch lacks it (TRL uses FlashAttention-3 varlen the same way).
- "flash_split": the same attention as two varlen calls merged by log-sum-exp (grpo/kernels/tree_split.py): each segment
  causally over itself in place, plus the children of each parent over the parent's path gathered once per parent,
  not once per child; on CPU it runs a dense reference of the flash contract (the tests' path). auto's choice on
  an sm80+ GPU (flash_varlen when torch lacks its FlashAttention ops).
- "flex": FlexAttention with the Euler-tour ancestor mask k <= q < subtree_end[k] (TRL PR #7328; AReaL), compiled
  on CUDA. No K/V duplication.
- "sdpa": dense [N, N] ancestor mask + SDPA, GQA by repeating K/V heads; the CPU reference.
- "gathered_sdpa": formulation 1 written with a dense [N, K] mask over the gathered K/V; checks kv_index and the
  cu_seqlens on CPU (test oracle, O(N K) memory).

Qwen3.5 (`Qwen3_5ForConditionalGeneration`): only the text stack runs; its full-attention layers go through this
function and position ids are the depth on all four M-RoPE rows (text-only, so temporal = height = width =
depth). Its Gated DeltaNet layers are NOT made tree-aware here: `grpo/kernels/gdn.py` reads `ACTIVE_ROW` (or the
`tree_context` keyword) and patches them.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from grpo.kernels import repeat_kv, varlen_mask
from grpo.logit_transforms import UnsupportedModelError, attention_softcap
from grpo.row_context import ACTIVE_ROW, run_row_hooks
from grpo.trie import PackedRow

logger = logging.getLogger(__name__)

ATTN_NAME = "grpo_tree"
BACKENDS = ("flash_varlen", "flash_split", "flex", "sdpa", "gathered_sdpa")
CAP_BACKENDS = ("flex", "sdpa", "gathered_sdpa")
"""The backends that compute attention-logit soft capping (Gemma 2's attn_logit_softcapping)."""

_logged: set[str] = set()
_compiled_flex = None


@dataclass
class TreeContext:
    """Per-forward state shared by every layer: the row on device and masks built once, lazily."""

    row: PackedRow
    backend: str
    cache: dict = field(default_factory=dict)
    split_plan: tuple | None = None  # flash_split: the row's plan as tensors (grpo/kernels/tree_split.py `plan_tensors`)
    gdn_tables: tuple | None = None  # set by a row hook (grpo/row_context.py) where GDN layers are compiled whole


# --------------------------------------------------------------------------------------------- backend choice

def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def _takes_enable_gqa(fn) -> bool:
    """Whether torch's varlen attention takes `enable_gqa` (read once, not per layer call)."""
    return "enable_gqa" in inspect.signature(fn).parameters


def _kernels_flash_varlen():
    """`flash_attn_varlen_func` from the `kernels` hub flash-attn kernel, or None (needs a cached download)."""
    try:
        from kernels import get_kernel

        for repo in ("kernels-community/flash-attn3", "kernels-community/flash-attn"):
            try:
                return get_kernel(repo).flash_attn_varlen_func
            except Exception:  # noqa: BLE001 - any failure means "not loadable here", reported by the caller
                continue
    except ImportError:
        return None
    return None


def _split_available(device: torch.device) -> bool:
    """torch's own FlashAttention varlen ops (what `flash_split` calls) on an sm80+ NVIDIA device (ROCm builds
    route them elsewhere, with another lse layout: checked only on CUDA)."""
    return (torch.version.cuda is not None and hasattr(torch.ops.aten, "_flash_attention_forward")
            and torch.cuda.get_device_capability(device) >= (8, 0))


def _flex_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def _log_once(message: str) -> None:
    if message not in _logged:
        _logged.add(message)
        logger.info(message)


def _cap_refused_on(device: torch.device) -> str | None:
    """Why attention-logit soft capping is refused on this device, per the spec: AMD and NVIDIA Blackwell GPUs
    (their attention kernels have no cap); None where it runs."""
    if device.type != "cuda":
        return None
    if torch.version.hip is not None:
        return "an AMD GPU"
    return "an NVIDIA Blackwell GPU" if torch.cuda.get_device_capability(device)[0] >= 10 else None


def select_backend(requested: str = "auto", device: torch.device | str = "cpu", softcap: bool = False) -> str:
    """Resolve `requested` ("auto" or one of BACKENDS) for `device`; logs one line saying which and why.

    `softcap`: the model soft-caps its attention logits (Gemma 2), which only `CAP_BACKENDS` compute: auto picks
    flex (CUDA) or sdpa, an explicit other choice is refused with the reason."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    if softcap:
        return _select_cap_backend(requested, device)
    if requested == "auto":
        if cuda and _split_available(device):
            choice, why = "flash_split", ("CUDA device with torch's FlashAttention: each shared prefix read once per "
                                          "parent (2.75x vs 2.61x tree/plain for flash_varlen, Qwen3-1.7B on an H200)")
        elif cuda and (_torch_varlen() is not None or _kernels_flash_varlen() is not None):
            choice, why = "flash_varlen", "CUDA device and a varlen attention kernel is available"
        elif cuda and _flex_available():
            choice, why = "flex", "CUDA device without a varlen kernel; FlexAttention is available"
        else:
            choice, why = "sdpa", f"{device.type} device: dense ancestor mask + SDPA (O(N^2) memory reference)"
    elif requested in BACKENDS:
        choice, why = requested, "requested explicitly"
        if requested == "flash_varlen" and not (cuda and (_torch_varlen() or _kernels_flash_varlen())):
            raise RuntimeError("tree attention backend 'flash_varlen' needs a CUDA device and torch>=2.10 "
                               "(torch.nn.attention.varlen) or a cached `kernels` flash-attn kernel; "
                               "use backend='flex' or 'sdpa'")
        if requested == "flash_split" and cuda and not _split_available(device):
            raise RuntimeError("tree attention backend 'flash_split' needs torch's FlashAttention ops "
                               "(aten::_flash_attention_forward) on an sm80+ GPU; use 'flash_varlen' or 'flex'")
        if requested == "flex" and not _flex_available():
            raise RuntimeError("tree attention backend 'flex' needs torch.nn.attention.flex_attention; use 'sdpa'")
    else:
        raise ValueError(f"unknown tree attention backend {requested!r}; choose 'auto' or one of {BACKENDS}")
    _log_once(f"tree attention backend: {choice} ({why})")
    return choice


def _select_cap_backend(requested: str, device: torch.device) -> str:
    if (where := _cap_refused_on(device)) is not None:
        raise UnsupportedModelError(f"the model soft-caps its attention logits (attn_logit_softcapping), which is "
                                    f"not supported on {where}; train it on another NVIDIA GPU or on CPU")
    if requested == "auto":
        choice = "flex" if device.type == "cuda" and _flex_available() else "sdpa"
        why = "the model soft-caps its attention logits: the flash kernels have no cap"
    elif requested in CAP_BACKENDS:
        if requested == "flex" and not _flex_available():
            raise RuntimeError("tree attention backend 'flex' needs torch.nn.attention.flex_attention; use 'sdpa'")
        choice, why = requested, "requested explicitly"
    elif requested in BACKENDS:
        raise UnsupportedModelError(f"attn_backend={requested!r} cannot soft-cap attention logits "
                                    f"(attn_logit_softcapping, e.g. Gemma 2): the flash kernels have no cap; use "
                                    f"attn_backend=auto or one of {CAP_BACKENDS}")
    else:
        raise ValueError(f"unknown tree attention backend {requested!r}; choose 'auto' or one of {BACKENDS}")
    _log_once(f"tree attention backend: {choice} ({why})")
    return choice


# --------------------------------------------------------------------------------------------- backends

def _capped_attention(query, key, value, mask, scaling, softcap):
    """softmax(cap tanh(q·kᵀ scale / cap) masked) v in explicit math, as transformers' eager attention computes it
    (SDPA has no score hook): query [1, H, N, D], key/value [1, H, K, D], mask [N, K] bool -> [1, H, N, D]."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # [1, H, N, K]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(probs, value)

def _dense_mask(ctx: TreeContext, window: int | None) -> torch.Tensor:
    key = ("dense", window)
    if key not in ctx.cache:
        mask = ctx.row.ancestor_mask()  # [N, N]
        if window is not None:
            depth = ctx.row.position_ids
            mask = mask & ((depth[:, None] - depth[None, :]) < window)
        ctx.cache[key] = mask
    return ctx.cache[key]


def _sdpa(ctx, query, key, value, scaling, window, softcap=None):
    # query [1, H, N, D], key/value [1, Hkv, N, D]
    mask = _dense_mask(ctx, window)
    heads = query.shape[1]
    if softcap is not None:
        return _capped_attention(query, repeat_kv(key, heads), repeat_kv(value, heads), mask, scaling,
                                 softcap).transpose(1, 2)
    out = F.scaled_dot_product_attention(query, repeat_kv(key, heads), repeat_kv(value, heads),
                                         attn_mask=mask, scale=scaling)  # [1, H, N, D]
    return out.transpose(1, 2)


def _gathered_mask(ctx: TreeContext, window: int | None) -> torch.Tensor:
    """[N, K] bool: query j of a segment of length Lq over a path of length Lk sees path keys 0 .. Lk - Lq + j."""
    key = ("gathered", window)
    if key not in ctx.cache:
        ctx.cache[key] = varlen_mask(ctx.row.cu_seqlens_q, ctx.row.cu_seqlens_k, True, window)
    return ctx.cache[key]


def _path_kv(row: PackedRow, key: torch.Tensor, dim: int) -> torch.Tensor:
    """`key` gathered along `dim` into each segment's root-to-segment path (kv_index order), or `key` itself when
    nothing is shared (kv_index = arange(N)): no copy forward, no scatter-add backward."""
    return key if row.kv_is_identity else key.index_select(dim, row.kv_index)


def _gathered_sdpa(ctx, query, key, value, scaling, window, softcap=None):
    heads = query.shape[1]
    key_g = repeat_kv(_path_kv(ctx.row, key, 2), heads)  # [1, H, K, D]
    value_g = repeat_kv(_path_kv(ctx.row, value, 2), heads)  # [1, H, K, D]
    if softcap is not None:
        return _capped_attention(query, key_g, value_g, _gathered_mask(ctx, window), scaling,
                                 softcap).transpose(1, 2)
    out = F.scaled_dot_product_attention(query, key_g, value_g, attn_mask=_gathered_mask(ctx, window),
                                         scale=scaling)  # [1, H, N, D]
    return out.transpose(1, 2)


def _flash_dtype(query: torch.Tensor) -> torch.dtype:
    """FlashAttention runs in fp16/bf16 only; fp32 masters under autocast still reach here in fp32 after RoPE."""
    return query.dtype if query.dtype in (torch.float16, torch.bfloat16) else (
        torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.bfloat16)


def _flash_varlen(ctx, query, key, value, scaling, window):
    row = ctx.row
    out_dtype = query.dtype
    half = _flash_dtype(query)
    # squeeze, not [0]: a select's backward fills a zero tensor and copies into it (~5 ms a step on Qwen3-0.6B)
    q = query.squeeze(0).transpose(0, 1).to(half)  # [N, H, D]
    k = _path_kv(row, key.squeeze(0).transpose(0, 1), 0).to(half)  # [K, Hkv, D], prefixes gathered per descendant
    v = _path_kv(row, value.squeeze(0).transpose(0, 1), 0).to(half)  # [K, Hkv, D]
    left = -1 if window is None else window - 1
    varlen = _torch_varlen()
    if varlen is not None:
        kwargs = {"scale": scaling, "window_size": (left, 0)}
        if k.shape[1] != q.shape[1] and _takes_enable_gqa(varlen):
            kwargs["enable_gqa"] = True
        out = varlen(q, k, v, row.cu_seqlens_q, row.cu_seqlens_k, row.max_seqlen_q, row.max_seqlen_k, **kwargs)
    else:
        flash = ctx.cache.get("kernels_flash") or _kernels_flash_varlen()
        ctx.cache["kernels_flash"] = flash
        out = flash(q, k, v, row.cu_seqlens_q, row.cu_seqlens_k, row.max_seqlen_q, row.max_seqlen_k,
                    softmax_scale=scaling, causal=True, window_size=(left, 0))
        out = out[0] if isinstance(out, tuple) else out
    return out[None].to(out_dtype)  # [1, N, H, D]


def _flash_split(ctx, query, key, value, scaling, window):
    if window is not None:  # no sliding window in the split formulation: the path-gathering one takes the layer
        _log_once("tree attention flash_split: sliding-window layers run the path-gathering formulation")
        return (_flash_varlen if query.is_cuda else _gathered_sdpa)(ctx, query, key, value, scaling, window)
    from grpo.kernels.tree_split import split_attention

    dtype = _flash_dtype(query) if query.is_cuda else query.dtype
    q, k, v = (x.squeeze(0).transpose(0, 1).to(dtype) for x in (query, key, value))  # [N, H or Hkv, D]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return split_attention(ctx.row, q, k, v, scale, flash=query.is_cuda)[None].to(query.dtype)  # [1, N, H, D]


def _block_mask(ctx: TreeContext, window: int | None):
    key = ("block", window)
    if key not in ctx.cache:
        from torch.nn.attention.flex_attention import create_block_mask

        subtree_end, depth = ctx.row.subtree_end, ctx.row.position_ids

        def ancestor(b, h, q_idx, kv_idx):
            allowed = (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])
            if window is not None:
                allowed = allowed & ((depth[q_idx] - depth[kv_idx]) < window)
            return allowed

        n = ctx.row.num_tokens
        device = ctx.row.input_ids.device
        ctx.cache[key] = create_block_mask(ancestor, None, None, n, n, device=device, _compile=device.type == "cuda")
    return ctx.cache[key]


def _flex_fn(device: torch.device):
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention  # eager flex on CPU materialises scores: fine for tiny test models
    if _compiled_flex is None:
        # dynamic=True: row lengths change every micro-batch; static shapes would recompile per length
        _compiled_flex = torch.compile(flex_attention, dynamic=True)
    return _compiled_flex


@functools.cache
def _softcap_score_mod(softcap: float):
    """Flex's score hook for a soft cap, one function per cap value: the compiled flex guards on the function, so
    a fresh closure per layer call would recompile."""
    def score_mod(score, b, h, q_idx, kv_idx):  # flex has already applied `scale` to score
        return torch.tanh(score / softcap) * softcap
    return score_mod


def _flex(ctx, query, key, value, scaling, window, softcap=None):
    block_mask = _block_mask(ctx, window)
    enable_gqa = key.shape[1] != query.shape[1]
    score_mod = None if softcap is None else _softcap_score_mod(float(softcap))
    out = _flex_fn(query.device)(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scaling,
                                 enable_gqa=enable_gqa)
    return out.transpose(1, 2)  # [1, N, H, D]


_BACKEND_FN = {"sdpa": _sdpa, "gathered_sdpa": _gathered_sdpa, "flash_varlen": _flash_varlen,
               "flash_split": _flash_split, "flex": _flex}


def tree_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, sliding_window: int | None = None,
                           tree_context: TreeContext | None = None, **kwargs):
    """transformers attention function: query [1, H, N, D], key/value [1, Hkv, N, D] -> ([1, N, H, D], None).

    Under torch.compile, `flash_split` (full-attention layers, bf16/fp16 on CUDA or any dtype on CPU) runs as a
    custom op that a layer compiled whole (`compile_scope="layers"`) keeps inside its graph, forward and backward:
    its arguments are tensors only (`split_attention_in_graph`). Every other case (eager layers included: there the
    autograd Function costs less than a custom op's dispatch) runs `_tree_attention_eager`, which dynamo never
    traces (the layer's graph breaks there): the row's Python ints (max_seqlen_*) and per-forward cache would
    otherwise become guards and recompile every row."""
    if (torch.compiler.is_compiling() and tree_context is not None and tree_context.split_plan is not None
            and sliding_window is None and not dropout and query.shape[0] == 1
            and (not query.is_cuda or query.dtype in (torch.float16, torch.bfloat16))):
        from grpo.kernels.tree_split import split_attention_in_graph

        q, k, v = (x.squeeze(0).transpose(0, 1) for x in (query, key, value))  # [N, H or Hkv, D]
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return split_attention_in_graph(tree_context.split_plan, q, k, v, scale, query.is_cuda)[None], None
    return _tree_attention_eager(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                 tree_context, **kwargs)


@torch.compiler.disable
def _tree_attention_eager(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, sliding_window: int | None = None,
                          tree_context: TreeContext | None = None, **kwargs):
    """Every backend in eager mode, never traced by dynamo (see `tree_attention_forward`)."""
    if tree_context is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if kwargs.get("softcap") is not None or sliding_window is not None:
            return _plain_attention(module, query, key, value, attention_mask, dropout, scaling, sliding_window,
                                    kwargs.get("softcap")), None
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"tree attention packs one row per forward (batch 1), got batch {query.shape[0]}")
    if dropout:
        raise ValueError("tree attention does not implement attention dropout; set attention_dropout=0")
    _refuse_unknown_scores(module, kwargs)
    fn = _BACKEND_FN[tree_context.backend]
    softcap = kwargs.get("softcap")
    if softcap is None:
        return fn(tree_context, query, key, value, scaling, sliding_window), None
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling  # transformers' default, as a number
    if tree_context.backend not in CAP_BACKENDS:
        raise UnsupportedModelError(f"{type(module).__name__} soft-caps its attention logits (softcap={softcap}) "
                                    f"but the tree backend is {tree_context.backend!r}, which cannot; use "
                                    f"attn_backend=auto or one of {CAP_BACKENDS}")
    return fn(tree_context, query, key, value, scaling, sliding_window, softcap), None


def _plain_attention(module, query, key, value, attention_mask, dropout, scaling, window, softcap):
    """An ordinary (not tree-packed) forward of a model switched to `grpo_tree` whose layer has a sliding window or
    a soft cap: transformers builds no mask for a custom attention name, and SDPA alone would drop both, so the
    causal (bottom-right aligned) and window mask is built here. query [B, H, Lq, D] -> [B, Lq, H, D]."""
    if dropout:
        raise ValueError("tree attention does not implement attention dropout; set attention_dropout=0")
    q_len, k_len = query.shape[2], key.shape[2]
    q_pos = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
    k_pos = torch.arange(k_len, device=query.device)[None, :]
    mask = k_pos <= q_pos  # [Lq, Lk]
    if window is not None:
        mask = mask & (q_pos - k_pos < window)
    if attention_mask is not None:
        given = attention_mask if attention_mask.dtype == torch.bool else attention_mask > torch.finfo(
            attention_mask.dtype).min / 2
        mask = mask & given
    heads = query.shape[1]
    key, value = repeat_kv(key, heads), repeat_kv(value, heads)
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if softcap is not None:
        return _capped_attention(query, key, value, mask, scaling, softcap).transpose(1, 2)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling).transpose(1, 2)


def _refuse_unknown_scores(module, kwargs: dict) -> None:
    """Attention inputs that change the scores and that no tree backend computes: attention sinks (`s_aux`,
    gpt-oss) and a non-causal layer."""
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(f"{type(module).__name__} uses attention sinks (s_aux), which the tree attention "
                                    "backends do not compute; this model cannot be trained with grpo yet")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedModelError(f"{type(module).__name__} is a non-causal attention layer; tree attention is "
                                    "causal by construction: train a causal language model")


# --------------------------------------------------------------------------------------------- model glue

def text_decoder(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack whose output is the final-norm hidden state (Qwen3, Qwen3-MoE, Qwen3.5 text stack)."""
    inner = getattr(model, "model", model)
    return getattr(inner, "language_model", inner)


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """[V, H] output projection (tied or not) for the caller's chunked logprobs."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings; pass a *ForCausalLM or "
                         "*ForConditionalGeneration model")
    return head.weight


def install_tree_attention(model: torch.nn.Module) -> None:
    """Register `grpo_tree` and switch the text decoder to it (idempotent; other calls fall back to SDPA)."""
    from transformers import AttentionInterface

    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, tree_attention_forward)
    decoder = text_decoder(model)
    if decoder.config._attn_implementation != ATTN_NAME:
        decoder.set_attn_implementation(ATTN_NAME)


def forward_hidden(model: torch.nn.Module, row: PackedRow, backend: str = "auto") -> torch.Tensor:
    """Final-norm hidden states [N, hidden] of `row`'s tree-packed forward. Logits are the caller's business
    (chunked over hidden[row.token_index] with `lm_head_weight(model)`), so the [N, V] matrix never exists."""
    return forward_decoder(model, row, backend).last_hidden_state[0]  # [N, hidden]


def forward_decoder(model: torch.nn.Module, row: PackedRow, backend: str = "auto", **decoder_kwargs):
    """The decoder's output object for `row` (e.g. with `output_router_logits=True` for MoE load balancing)."""
    decoder = text_decoder(model)
    device = decoder.embed_tokens.weight.device
    install_tree_attention(model)
    backend = select_backend(backend, device, softcap=attention_softcap(model) is not None)
    if row.input_ids.device != device:
        row = row.to(device, non_blocking=True)
    ctx = TreeContext(row=row, backend=backend)
    if backend == "flash_split":
        from grpo.kernels.tree_split import plan_tensors

        ctx.split_plan = plan_tensors(row)
    run_row_hooks(decoder, ctx)  # e.g. the mixer tables of GDN layers compiled whole (grpo/model.py)
    token = ACTIVE_ROW.set(row)
    try:
        out = decoder(input_ids=row.input_ids[None], position_ids=row.position_ids[None], use_cache=False,
                      tree_context=ctx, **decoder_kwargs)
    finally:
        ACTIVE_ROW.reset(token)
    return out
