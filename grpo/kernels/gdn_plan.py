"""The index tables a packed trie row needs in every Gated DeltaNet layer (grpo/kernels/gdn.py), built once per row with
numpy on the host and moved to the device in one copy: the conv's path windows (`conv_index_table`, and the few rows
a contiguous conv gets wrong, `conv_fix_index`), each segment-tree level's padded batch and varlen bounds, the
row's level-major permutation, and FLA's segment bounds and chunk tables for the one-pass rule (grpo/kernels/gdn_fla.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from grpo.kernels.gdn_kernel import CHUNK


@dataclass(frozen=True)
class LevelPlan:
    """The segments of one segment-tree level, right-padded into a batch."""

    gather_index: torch.Tensor  # [B, T] packed position of each slot; N (a zero row) for padding; T % CHUNK == 0
    valid: torch.Tensor  # [B, T] bool, False at padding
    valid_index: torch.Tensor  # [n_level] flat positions (in B x T) of the valid slots: no mask-indexing sync
    parent_slot: torch.Tensor | None  # [B] row of the parent in the previous level's final states; None for roots
    flat_index: torch.Tensor  # [n_level] packed positions of the level's tokens, segment after segment (varlen)
    flat_range: tuple[int, int] | None  # (start, stop) when flat_index is that range of the row (a slice, no gather)
    cu_seqlens: torch.Tensor  # [B + 1] long, segment bounds within flat_index (on the row's device)
    cu_seqlens_cpu: torch.Tensor  # the same on the CPU (a varlen kernel reads it without a device sync)


@dataclass(frozen=True)
class TreeScanPlan:
    """Index tables one packed row needs in every GDN layer (built once per row, shared by all layers)."""

    conv_index: torch.Tensor  # [N, K_c] packed index of each conv tap in transformers' weight order; N = zero row
    conv_fix_index: torch.Tensor  # [M] rows whose conv window is not the contiguous one (`conv_fix_index`)
    ordered_conv_index: torch.Tensor  # [N, K_c] conv_index of the row in its level-major order (below)
    ordered_conv_fix_index: torch.Tensor  # [M'] conv_fix_index of the row in that order
    ordered_fix_window: torch.Tensor  # [M', K_c] ordered_conv_index at those rows
    levels: list[LevelPlan]
    unpermute: torch.Tensor  # [N] position of packed token n in the level-major concatenation of valid slots
    order: torch.Tensor  # [N] packed position of each level-major slot: unpermute's inverse
    seg_cu_seqlens: torch.Tensor  # [S + 1] long, segment bounds in the level-major order (FLA's cu_seqlens)
    parent_slots: torch.Tensor  # [S - B_0] long, the levels' parent_slot after level 0, concatenated
    chunk_indices: torch.Tensor  # [NT, 2] long, (segment, chunk within it) of each 64-token chunk, level-major
    chunk_offsets: torch.Tensor  # [S + 1] long, each segment's first chunk in chunk_indices
    level_segments: tuple[int, ...]  # first segment of each level in the level-major order, then S
    level_major: bool = False  # True when that concatenation is the row itself (both are the identity)

    def to(self, device, packed: bool | None = None) -> TreeScanPlan:
        """The plan on `device`, every table in one copy (grpo/trie.py `to_device`); cu_seqlens_cpu stays."""
        from dataclasses import replace

        from grpo.trie import to_device

        level_fields = ("gather_index", "valid", "valid_index", "parent_slot", "flat_index", "cu_seqlens")
        heads = ("conv_index", "conv_fix_index", "ordered_conv_index", "ordered_conv_fix_index", "ordered_fix_window",
                 "unpermute", "order", "seg_cu_seqlens", "chunk_indices", "chunk_offsets", "parent_slots")
        flat = [getattr(self, name) for name in heads]
        flat += [getattr(level, name) for level in self.levels for name in level_fields]
        moved = iter(to_device(flat, device, packed))
        head = {name: next(moved) for name in heads}
        levels = [replace(level, **{name: next(moved) for name in level_fields}) for level in self.levels]
        return replace(self, levels=levels, **head)


def row_plan(row, kernel_size: int) -> TreeScanPlan:
    """`plan_tree_scan` of `row`, built from its CPU twin when it has one (`PackedRow.host`: no device reads, no
    small copies, each of which drained the GPU's queue) and moved in one copy."""
    host = row.host if row.host is not None else row
    plan = plan_tree_scan(host.token_pred, host.cu_seqlens_q, host.seg_parent, kernel_size)
    return plan if host is row else plan.to(row.input_ids.device)


def conv_index_table(token_pred: torch.Tensor, kernel_size: int) -> torch.Tensor:
    """[N, K_c] table whose column i holds pred_{K_c-1-i}(n) (N past the root), matching `nn.Conv1d` taps.

    transformers' causal conv computes out[t] = sum_i w[i] x[t - (K_c - 1) + i], so tap i reads the input
    K_c - 1 - i steps back along the token's own path. Built with numpy on the host (`_conv_index_table`), returned
    on token_pred's device.
    """
    return torch.from_numpy(_conv_index_table(token_pred.cpu().numpy(), kernel_size)).to(token_pred.device)


def _conv_index_table(token_pred: np.ndarray, kernel_size: int) -> np.ndarray:
    n_tokens = token_pred.shape[0]
    pred = np.arange(n_tokens, dtype=np.int64)  # [N] pred_0(n) = n
    columns = [pred]
    for _ in range(kernel_size - 1):
        pred = np.where(pred >= 0, token_pred[np.maximum(pred, 0)], pred)
        columns.append(pred)
    table = np.stack(columns[::-1], axis=1)  # [N, K_c]
    return np.where(table >= 0, table, n_tokens)


def segment_levels(seg_parent: list[int]) -> list[int]:
    """Depth of every segment in the segment tree; parents must precede children (DFS pre-order)."""
    levels: list[int] = []
    for seg, parent in enumerate(seg_parent):
        if parent >= seg:
            raise ValueError(f"segment {seg} has parent {parent}: rows must list segments in DFS pre-order "
                             "(build them with grpo.trie.pack_samples)")
        levels.append(0 if parent < 0 else levels[parent] + 1)
    return levels


def plan_tree_scan(token_pred: torch.Tensor, cu_seqlens: torch.Tensor, seg_parent: torch.Tensor,
                   kernel_size: int) -> TreeScanPlan:
    """Build the conv index table and the per-level padded batches of one packed row: with numpy on the host (one
    memcpy-speed op per table, no torch op dispatch or intra-op thread pool), moved to token_pred's device in one
    copy."""
    bounds = cu_seqlens.cpu().numpy().astype(np.int64)
    parents = seg_parent.tolist()
    levels = segment_levels(parents)
    slot_in_level: dict[int, int] = {}
    by_level: list[list[int]] = [[] for _ in range(max(levels, default=-1) + 1)]
    for seg, level in enumerate(levels):
        slot_in_level[seg] = len(by_level[level])
        by_level[level].append(seg)
    n_tokens = token_pred.shape[0]
    plans = [_level_plan(bounds, np.asarray(segs, dtype=np.int64), n_tokens,
                         None if level == 0 else [slot_in_level[parents[s]] for s in segs])
             for level, segs in enumerate(by_level)]
    order = np.concatenate([p.flat_index.numpy() for p in plans]) if plans else np.zeros(0, np.int64)
    unpermute = np.empty_like(order)
    unpermute[order] = np.arange(order.shape[0])  # the inverse permutation (order is one)
    conv_index = _conv_index_table(token_pred.cpu().numpy(), kernel_size)
    stops = [p.flat_range for p in plans]
    level_major = all(r is not None for r in stops) and [r[0] for r in stops] == [0] + [r[1] for r in stops[:-1]]
    segs = np.concatenate([np.asarray(s, dtype=np.int64) for s in by_level]) if by_level else np.zeros(0, np.int64)
    lengths = bounds[segs + 1] - bounds[segs]  # [S] level-major
    ordered_conv = conv_index if level_major else _reindexed(conv_index[order], unpermute)
    ordered_fix = _conv_fix_index(ordered_conv)
    conv_tables = [torch.from_numpy(t) for t in (conv_index, _conv_fix_index(conv_index), ordered_conv, ordered_fix,
                                                 ordered_conv[ordered_fix])]
    cu, chunk_indices, chunk_offsets = _chunk_tables(lengths)
    parent_slots = torch.cat([p.parent_slot for p in plans[1:]]) if len(plans) > 1 else torch.zeros(0, dtype=torch.long)
    plan = TreeScanPlan(*conv_tables, plans, torch.from_numpy(unpermute), torch.from_numpy(order), cu, parent_slots,
                        chunk_indices, chunk_offsets, tuple(np.cumsum([0] + [len(s) for s in by_level]).tolist()),
                        level_major)
    return plan if token_pred.device.type == "cpu" else plan.to(token_pred.device)


def _reindexed(table: np.ndarray, position: np.ndarray) -> np.ndarray:
    """`table`'s packed positions n mapped to position[n]; n = N (the zero tap) stays N."""
    n_tokens = position.shape[0]
    return np.where(table < n_tokens, position[np.minimum(table, n_tokens - 1)], n_tokens)


def _chunk_tables(lengths: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cu_seqlens [S + 1], chunk_indices [NT, 2], chunk_offsets [S + 1]) of segments of `lengths` laid end to end,
    as FLA's varlen kernels index them: (segment, chunk within the segment) for every 64-token chunk."""
    chunks = -(-lengths // CHUNK)  # [S]
    offsets = np.concatenate([[0], np.cumsum(chunks)]).astype(np.int64)  # [S + 1]
    seg_of_chunk = np.repeat(np.arange(len(lengths), dtype=np.int64), chunks)  # [NT]
    chunk_in_seg = np.arange(offsets[-1], dtype=np.int64) - offsets[seg_of_chunk]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return (torch.from_numpy(cu), torch.from_numpy(np.stack([seg_of_chunk, chunk_in_seg], axis=1)),
            torch.from_numpy(offsets))


def _level_plan(bounds: np.ndarray, segs: np.ndarray, n_tokens: int, parent_slot: list[int] | None) -> LevelPlan:
    """One level's tables on the host: its segments right-padded to whole chunks, and their varlen bounds."""
    starts, lengths = bounds[segs], bounds[segs + 1] - bounds[segs]  # [B]
    offsets = np.arange(-(-int(lengths.max()) // CHUNK) * CHUNK)  # [T], whole chunks
    valid = offsets[None, :] < lengths[:, None]  # [B, T]
    gather_index = np.where(valid, starts[:, None] + offsets[None, :], n_tokens)  # [B, T]
    cu_cpu = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]))  # [B + 1]
    consecutive = bool(np.all(bounds[segs[:-1] + 1] == bounds[segs[1:]]))
    flat_range = (int(bounds[segs[0]]), int(bounds[segs[-1] + 1])) if consecutive else None
    return LevelPlan(torch.from_numpy(gather_index), torch.from_numpy(valid), torch.from_numpy(np.flatnonzero(valid)),
                     None if parent_slot is None else torch.tensor(parent_slot, dtype=torch.long),
                     torch.from_numpy(gather_index[valid]), flat_range, cu_cpu, cu_cpu)


def conv_fix_index(conv_index: torch.Tensor) -> torch.Tensor:
    """[M] packed positions whose path window differs from the packed positions just before them (a root that is
    not first in the row, a later sibling, and the K_c - 1 tokens after each): the only rows a contiguous causal
    conv gets wrong. A first child follows its parent in the row (DFS pre-order), so its window is contiguous."""
    return torch.from_numpy(_conv_fix_index(conv_index.cpu().numpy())).to(conv_index.device)


def _conv_fix_index(conv_index: np.ndarray) -> np.ndarray:
    n_tokens, kernel_size = conv_index.shape
    contiguous = np.arange(n_tokens)[:, None] + np.arange(1 - kernel_size, 1)[None, :]  # [N, K_c]
    contiguous = np.where(contiguous >= 0, contiguous, n_tokens)
    return np.flatnonzero((conv_index != contiguous).any(axis=1))
