"""Prefix-trie ("tree") packing of training samples into one row (docs/design.md §7).

Nodes are keyed by (token, next token), so two samples share a node only when they agree on the token *and* on
what it predicts: the trie forks one token before the divergence and every node has one prediction target.
We build it as a radix tree over each sample's key sequence (unary chains are edges, compared with vectorised
numpy longest-common-prefix), so Python work is per segment, not per token. Segments are laid out in DFS
pre-order with children in insertion order; each occupies a contiguous packed range, and a segment's path is
its parent's path plus its own range.

`share_prefixes=False` is ordinary padding-free packing: every sample is a root segment whose path is itself.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import torch

from grpo.samples import TrainingSample


@dataclass
class PackedRow:
    """One rank's forward for a micro-batch: N packed tokens, S segments, K = sum of path lengths, M loss terms."""

    input_ids: torch.Tensor  # [N] long
    position_ids: torch.Tensor  # [N] long, depth in the trie
    shift_labels: torch.Tensor  # [N] long, the unique next token where a loss term sits, else -100
    cu_seqlens_q: torch.Tensor  # [S+1] int32, segment bounds in packed positions
    cu_seqlens_k: torch.Tensor  # [S+1] int32, path bounds in kv_index
    kv_index: torch.Tensor  # [K] long, packed positions of each segment's root-to-segment path
    max_seqlen_q: int
    max_seqlen_k: int
    seg_parent: torch.Tensor  # [S] long, -1 for roots
    token_pred: torch.Tensor  # [N] long, packed index of the previous token on its own path, -1 at a root start
    subtree_end: torch.Tensor  # [N] long, Euler-tour tout: k is ancestor-or-self of q iff k <= q < subtree_end[k]
    token_index: torch.Tensor  # [M] long, packed index whose output predicts the target
    targets: torch.Tensor  # [M] long
    sampler_logprobs: torch.Tensor  # [M] float32
    advantages: torch.Tensor  # [M] float32
    sample_id: torch.Tensor  # [M] long, index of the sample within the row
    sampler_top_ids: torch.Tensor | None  # [M, k] long, -1 = padding
    sampler_top_logprobs: torch.Tensor | None  # [M, k] float32, -inf = padding
    sampling_mask: torch.Tensor | None  # [M, C] long candidate ids, -1 padding; an all -1 row = full vocabulary
    num_samples: int
    num_raw_tokens: int
    num_groups: int
    attention_cost: int  # sum over nodes of (depth + 1)
    # Part 2 of the split attention (grpo/kernels/tree_split.py): each non-root token against its parent's root-to-parent
    # path. Grouped (anc_in_place False): the queries of each parent's children (their own tokens, gathered) against
    # the path, P parents with children, Qa queries, Ka keys. In place (True, where each parent's children lie
    # together in the row, as in every two-level trie): the row itself cut into R runs of consecutive segments with
    # the same parent (a root's run has no keys), so the queries need no gather; anc_q_index is then the [N] bool
    # mask of the tokens that have a parent
    anc_q_index: torch.Tensor | None = None  # [Qa] long, or [N] bool in place
    anc_cu_q: torch.Tensor | None = None  # [P+1] int32, or [R+1] in place (run bounds in the row)
    anc_kv_index: torch.Tensor | None = None  # [Ka] long
    anc_cu_k: torch.Tensor | None = None  # [P+1] int32, or [R+1] in place
    anc_max_q: int = 0
    anc_max_k: int = 0
    anc_in_place: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_loss_terms(self) -> int:
        return int(self.token_index.numel())

    @property
    def num_segments(self) -> int:
        return int(self.seg_parent.numel())

    @property
    def kv_is_identity(self) -> bool:
        """True when no segment has an ancestor (nothing shared): then kv_index is arange(N) and attention can read
        K/V in place. K = N + the ancestors' lengths summed over segments, so K == N says it without a device read."""
        return int(self.kv_index.numel()) == int(self.input_ids.numel())

    @property
    def packing_ratio(self) -> float:
        return self.num_raw_tokens / max(self.num_tokens, 1)

    def to(self, device, non_blocking: bool = False) -> PackedRow:
        """The row on `device`. A CPU row goes to a GPU in one pinned copy (`to_device`) and keeps its CPU twin as
        `host`, so index plans read host values there instead of syncing on the device's."""
        names = [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        moved = {f.name: getattr(self, f.name) for f in fields(self)}
        on_host = self.input_ids.device.type == "cpu"
        if on_host and torch.device(device).type == "cuda":
            moved.update(zip(names, to_device([moved[n] for n in names], device)))
        else:
            moved.update({n: moved[n].to(device, non_blocking=non_blocking) for n in names})
        row = PackedRow(**moved)
        row.sample_leaf = self.sample_leaf
        row.host = self if on_host else self.host
        return row

    def ancestor_mask(self) -> torch.Tensor:
        """Dense [N, N] bool, True where query q may attend key k (k is an ancestor-or-self of q). The reference."""
        n = self.num_tokens
        q = torch.arange(n, device=self.input_ids.device)[:, None]  # [N, 1]
        k = torch.arange(n, device=self.input_ids.device)[None, :]  # [1, N]
        return (k <= q) & (q < self.subtree_end[None, :])

    def sample_paths(self) -> list[torch.Tensor]:
        """Packed indices of every sample's tokens, in sample order (each sample ends at a leaf segment)."""
        return [self.kv_index[int(self.cu_seqlens_k[s]):int(self.cu_seqlens_k[s + 1])] for s in self.sample_leaf]

    sample_leaf: ClassVar[tuple[int, ...]] = ()
    """Leaf segment of each sample (set per instance by `pack_samples`; not a tensor field)."""
    host: ClassVar[PackedRow | None] = None
    """The CPU row this one was copied from (set per instance by `to`), None for a row built where it is."""


def to_device(tensors: list[torch.Tensor | None], device, packed: bool | None = None) -> list[torch.Tensor | None]:
    """CPU tensors on `device` (None passes through). To CUDA (or with `packed=True`) they travel as ONE buffer:
    packed byte-wise into pinned host memory, one non-blocking copy, views cut out on the device. A copy from
    pageable memory makes CUDA synchronise the stream first, so moving a row field by field drained the GPU's
    queue once per field while the host waited."""
    device = torch.device(device)
    if not (packed if packed is not None else device.type == "cuda"):
        return [t if t is None else t.to(device) for t in tensors]
    layout, offset = [], 0
    for t in tensors:
        nbytes = 0 if t is None else t.numel() * t.element_size()
        layout.append(None if t is None else (offset, nbytes, t.dtype, tuple(t.shape)))
        offset += -(-nbytes // 16) * 16  # 16-byte aligned views for every dtype
    buf = torch.empty(offset, dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = buf.numpy()  # numpy's copies are one plain memcpy each, on this thread (no intra-op thread pool)
    for t, place in zip(tensors, layout):
        if place is not None and place[1]:
            staging[place[0]:place[0] + place[1]] = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    buf = buf.to(device, non_blocking=True)
    return [None if place is None else buf[place[0]:place[0] + place[1]].view(place[2]).view(place[3])
            for place in layout]


def _keys(tokens: np.ndarray) -> np.ndarray:
    """(token, next token) keys as int64; the last token's next is an end marker (-1)."""
    nxt = np.empty_like(tokens)
    nxt[:-1] = tokens[1:]
    nxt[-1:] = -1
    return (tokens << 32) | (nxt + 1)


class _Segment:
    __slots__ = ("owner", "start", "end", "children", "pos")

    def __init__(self, owner: int, start: int, end: int):
        self.owner, self.start, self.end = owner, start, end  # keys[owner][start:end], start = depth of first node
        self.children: dict[int, _Segment] = {}  # first key -> child, dict order = insertion order
        self.pos = 0


def _lcp(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    diff = a[:m] != b[:m]
    first = int(diff.argmax())
    return first if diff[first] else m


def _build_radix(keys: list[np.ndarray], share: bool) -> tuple[list[_Segment], list[_Segment]]:
    """Insert every key sequence; return (root segments, leaf segment of each sample)."""
    roots: dict[int, _Segment] = {}
    root_list: list[_Segment] = []
    leaves: list[_Segment] = []
    for i, key in enumerate(keys):
        if not share:
            seg = _Segment(i, 0, len(key))
            root_list.append(seg)
            leaves.append(seg)
            continue
        children, depth, seg = roots, 0, None
        while depth < len(key):
            child = children.get(int(key[depth]))
            if child is None:
                seg = _Segment(i, depth, len(key))
                children[int(key[depth])] = seg
                depth = len(key)
                break
            own = keys[child.owner][child.start:child.end]
            match = _lcp(key[depth:], own)
            if match < len(own):  # split: a new top takes the shared part; `child` (maybe a leaf) keeps the rest
                top = _Segment(child.owner, child.start, child.start + match)
                top.children = {int(own[match]): child}
                children[int(key[depth])] = top  # same key, so the insertion order of siblings is unchanged
                child.start += match
                child = top
            seg, children, depth = child, child.children, depth + match
        leaves.append(seg)
    if share:
        root_list = list(roots.values())
    return root_list, leaves


def _layout(roots: list[_Segment]) -> tuple[list[_Segment], list[int], list[int]]:
    """DFS pre-order of segments; returns (order, parent index per segment, subtree end per segment)."""
    order: list[_Segment] = []
    parent: list[int] = []
    stack = [(seg, -1) for seg in reversed(roots)]
    pos = 0
    while stack:
        seg, par = stack.pop()
        seg.pos = pos
        pos += seg.end - seg.start
        parent.append(par)
        idx = len(order)
        order.append(seg)
        stack.extend((child, idx) for child in reversed(list(seg.children.values())))
    sub_end = [seg.pos + seg.end - seg.start for seg in order]
    for idx in range(len(order) - 1, 0, -1):  # children come after parents in pre-order
        if parent[idx] >= 0:
            sub_end[parent[idx]] = max(sub_end[parent[idx]], sub_end[idx])
    return order, parent, sub_end


def pack_samples(samples: list[TrainingSample], share_prefixes: bool = True) -> PackedRow:
    """Pack `samples` into one prefix-trie row (or plain padding-free packing with `share_prefixes=False`)."""
    if not samples:
        raise ValueError("pack_samples needs at least one sample; the batcher pads empty rows with a dummy sample")
    arrays = [s.arrays() for s in samples]  # (ids, mask, sampler log-probs); the worker attached them already
    tokens = [ids for ids, _, _ in arrays]
    if any(len(t) == 0 for t in tokens):
        raise ValueError("a TrainingSample has no tokens; drop it before packing")
    keys = [_keys(t) for t in tokens]
    roots, leaves = _build_radix(keys, share_prefixes)
    order, parent, sub_end = _layout(roots)
    seg_index = {id(seg): i for i, seg in enumerate(order)}

    seg_len, cu_q, input_ids, seg_of_token, position_ids = _flatten(order, tokens)
    paths, path_len, cu_k = _attention_paths(parent, cu_q)
    parent_arr = np.array(parent, dtype=np.int64)
    token_pred = _token_predecessors(parent_arr, cu_q, len(input_ids))
    subtree_end = np.asarray(sub_end, dtype=np.int64)[seg_of_token]

    leaf_ids = [seg_index[id(seg)] for seg in leaves]
    loss = _loss_terms(samples, arrays, [paths[j] for j in leaf_ids])
    shift_labels = np.full(len(input_ids), -100, dtype=np.int64)
    shift_labels[loss["token_index"]] = loss["targets"]

    row = PackedRow(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        shift_labels=torch.from_numpy(shift_labels),
        cu_seqlens_q=torch.from_numpy(cu_q.astype(np.int32)),
        cu_seqlens_k=torch.from_numpy(cu_k.astype(np.int32)),
        kv_index=torch.from_numpy(np.concatenate(paths)),
        max_seqlen_q=int(seg_len.max()),
        max_seqlen_k=int(path_len.max()),
        seg_parent=torch.from_numpy(parent_arr),
        token_pred=torch.from_numpy(token_pred),
        subtree_end=torch.from_numpy(subtree_end),
        num_samples=len(samples),
        num_raw_tokens=int(sum(len(t) for t in tokens)),
        num_groups=len({s.group_id for s in samples}),
        attention_cost=int(position_ids.sum() + len(position_ids)),
        **{k: v for k, v in loss.items() if k not in ("token_index", "targets")},
        token_index=torch.from_numpy(loss["token_index"]),
        targets=torch.from_numpy(loss["targets"]),
        **_ancestor_groups(parent, cu_q, paths),
    )
    row.sample_leaf = tuple(leaf_ids)
    return row


def _flatten(order: list[_Segment], tokens: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """Segments laid out back to back: (segment lengths [S], segment bounds cu_q [S+1], input_ids [N], segment of
    every token [N], trie depth of every token [N])."""
    seg_len = np.array([seg.end - seg.start for seg in order], dtype=np.int64)  # [S]
    cu_q = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(seg_len, out=cu_q[1:])
    input_ids = np.concatenate([tokens[seg.owner][seg.start:seg.end] for seg in order])  # [N]
    seg_of_token = np.repeat(np.arange(len(order)), seg_len)  # [N]
    offset_in_seg = np.arange(len(input_ids)) - cu_q[seg_of_token]
    depth_start = np.array([seg.start for seg in order], dtype=np.int64)
    position_ids = depth_start[seg_of_token] + offset_in_seg  # [N]
    return seg_len, cu_q, input_ids, seg_of_token, position_ids


def _attention_paths(parent: list[int], cu_q: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """Each segment's root-to-segment path of packed positions: (paths, path lengths [S], path bounds cu_k [S+1])."""
    paths: list[np.ndarray] = []
    for i in range(len(parent)):  # parents precede children, so their path is ready
        own = np.arange(cu_q[i], cu_q[i + 1])
        paths.append(own if parent[i] < 0 else np.concatenate([paths[parent[i]], own]))
    path_len = np.array([len(p) for p in paths], dtype=np.int64)
    cu_k = np.zeros(len(parent) + 1, dtype=np.int64)
    np.cumsum(path_len, out=cu_k[1:])
    return paths, path_len, cu_k


SPLIT_IN_PLACE = True
"""Whether rows may take the split attention's in-place part 2 (`_ancestor_runs`); False: always grouped (a bench
switch, `bench_step.py --set bench_split_grouped=true`)."""


def _ancestor_groups(parent: list[int], cu_q: np.ndarray, paths: list[np.ndarray]) -> dict:
    """The PackedRow fields anc_*: per parent with children (in segment order), its children's own tokens as
    queries and its root-to-parent path as keys (docs/design.md §7.1, the split formulation); in place instead
    (`_ancestor_runs`) where that gathers no more keys than the grouped plan gathers keys and queries."""
    children: dict[int, list[int]] = {}
    for seg, par in enumerate(parent):
        if par >= 0:
            children.setdefault(par, []).append(seg)
    parents = sorted(children)
    queries = [np.concatenate([np.arange(cu_q[c], cu_q[c + 1]) for c in children[p]]) for p in parents]
    keys = [paths[p] for p in parents]
    q_len = np.array([len(x) for x in queries], dtype=np.int64)
    k_len = np.array([len(x) for x in keys], dtype=np.int64)
    if parents and SPLIT_IN_PLACE:
        runs = _ancestor_runs(parent, cu_q, paths)
        if runs["anc_kv_index"].numel() <= k_len.sum() + q_len.sum():
            return runs
    empty = np.zeros(0, dtype=np.int64)
    return {
        "anc_q_index": torch.from_numpy(np.concatenate(queries) if parents else empty),
        "anc_cu_q": torch.from_numpy(np.concatenate([[0], np.cumsum(q_len)]).astype(np.int32)),
        "anc_kv_index": torch.from_numpy(np.concatenate(keys) if parents else empty),
        "anc_cu_k": torch.from_numpy(np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32)),
        "anc_max_q": int(q_len.max()) if parents else 0,
        "anc_max_k": int(k_len.max()) if parents else 0,
    }


def _ancestor_runs(parent: list[int], cu_q: np.ndarray, paths: list[np.ndarray]) -> dict:
    """The in-place part 2: the row cut into runs of consecutive segments with the same parent; a run's queries are
    its tokens where they lie, its keys the parent's path (none for a run of roots). Two-level tries have one run
    per parent, so the keys are the grouped plan's; deeper ones in pre-order split a parent's children into
    several runs where grandchildren lie between them, each reading the path again."""
    starts = [s for s in range(len(parent)) if s == 0 or parent[s] != parent[s - 1]]
    bounds = np.array([cu_q[s] for s in starts] + [cu_q[-1]], dtype=np.int64)
    keys = [paths[parent[s]] if parent[s] >= 0 else np.zeros(0, dtype=np.int64) for s in starts]
    k_len = np.array([len(x) for x in keys], dtype=np.int64)
    seg_len = np.diff(cu_q)
    has_parent = np.repeat(np.asarray(parent) >= 0, seg_len)
    return {
        "anc_q_index": torch.from_numpy(has_parent),
        "anc_cu_q": torch.from_numpy(bounds.astype(np.int32)),
        "anc_kv_index": torch.from_numpy(np.concatenate(keys)),
        "anc_cu_k": torch.from_numpy(np.concatenate([[0], np.cumsum(k_len)]).astype(np.int32)),
        "anc_max_q": int(np.diff(bounds).max()),
        "anc_max_k": int(k_len.max()),
        "anc_in_place": True,
    }


def _token_predecessors(parent_arr: np.ndarray, cu_q: np.ndarray, n: int) -> np.ndarray:
    """[N] packed index of the previous token on each token's own path: the token before it in its segment, the
    parent segment's last token at a segment start, -1 at a root start."""
    token_pred = np.arange(n) - 1
    seg_first = cu_q[:-1]
    parent_last = np.where(parent_arr >= 0, cu_q[np.maximum(parent_arr, 0) + 1] - 1, -1)
    token_pred[seg_first] = parent_last
    return token_pred


def _loss_terms(samples: list[TrainingSample], arrays: list[tuple], sample_paths: list[np.ndarray]) -> dict:
    """Per trained position i >= 1 of each sample: a term at the packed node of token i - 1, target token i."""
    token_index, targets, logprobs, advantages, sample_id, trained = [], [], [], [], [], []
    for s, (sample, (ids, mask, sampler_logprobs), path) in enumerate(zip(samples, arrays, sample_paths)):
        pos = np.flatnonzero(mask[1:]) + 1  # [m]; position 0 has no prefix to predict it from
        token_index.append(path[pos - 1])
        targets.append(ids[pos])
        logprobs.append(sampler_logprobs[pos])
        advantages.append(np.full(len(pos), sample.advantage, dtype=np.float32))
        sample_id.append(np.full(len(pos), s, dtype=np.int64))
        trained.append(pos)
    out = {
        "token_index": np.concatenate(token_index),
        "targets": np.concatenate(targets),
        "sampler_logprobs": torch.from_numpy(np.concatenate(logprobs)),
        "advantages": torch.from_numpy(np.concatenate(advantages)),
        "sample_id": torch.from_numpy(np.concatenate(sample_id)),
    }
    out.update(_top_logprobs(samples, trained))
    out["sampling_mask"] = _sampling_mask(samples, trained)
    return out


def _top_logprobs(samples: list[TrainingSample], trained: list[np.ndarray]) -> dict:
    """Sampler top-k ids/logprobs at trained positions; samples without them get padding (-1 / -inf)."""
    ks = [s.sampler_top_ids.shape[1] for s in samples if s.sampler_top_ids is not None]
    if not ks:
        return {"sampler_top_ids": None, "sampler_top_logprobs": None}
    k = max(ks)
    ids, lps = [], []
    for sample, pos in zip(samples, trained):
        block_ids = np.full((len(pos), k), -1, dtype=np.int64)
        block_lps = np.full((len(pos), k), -np.inf, dtype=np.float32)
        if sample.sampler_top_ids is not None:
            width = sample.sampler_top_ids.shape[1]
            block_ids[:, :width] = np.asarray(sample.sampler_top_ids)[pos]
            block_lps[:, :width] = np.asarray(sample.sampler_top_logprobs)[pos]
        ids.append(block_ids)
        lps.append(block_lps)
    return {"sampler_top_ids": torch.from_numpy(np.concatenate(ids)),
            "sampler_top_logprobs": torch.from_numpy(np.concatenate(lps))}


def _sampling_mask(samples: list[TrainingSample], trained: list[np.ndarray]) -> torch.Tensor | None:
    """[M, C] candidate ids padded with -1. A trained position without a mask (full vocabulary) is an all -1 row,
    which cannot be a real candidate set since the sampled token is always a candidate."""
    if all(sample.sampling_mask is None for sample in samples):
        return None
    rows = []
    for sample, pos in zip(samples, trained):
        masks = sample.sampling_mask
        rows.extend((masks[i] if masks is not None else None) for i in pos)
    if all(r is None for r in rows):
        return None
    width = max(len(r) for r in rows if r is not None)
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for j, cand in enumerate(rows):
        if cand is not None:
            out[j, :len(cand)] = cand
    return torch.from_numpy(out)
