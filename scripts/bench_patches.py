"""bench_step.py's switches: bench-only patches of the real step, so two variants can be timed side by side in one
process (nothing here changes what train.py runs). Each restores what it replaced on exit."""

from __future__ import annotations

import contextlib
import time


@contextlib.contextmanager
def plain_packing():
    """Bench-only: pack and budget rows with no prefix sharing (the padding-free baseline)."""
    import grpo.batcher as batcher
    import grpo.trie as trie

    pack, shared = trie.pack_samples, batcher._Row.shared_nodes
    trie.pack_samples = lambda samples, share_prefixes=True: pack(samples, share_prefixes=False)
    batcher._Row.shared_nodes = lambda self, marked: 0
    try:
        yield
    finally:
        trie.pack_samples, batcher._Row.shared_nodes = pack, shared


BENCH_SWITCHES = ("bench_split_in_graph", "bench_cpp_wrapper", "bench_gdn_per_level", "bench_split_grouped",
                  "bench_merge_compiled")
"""`--set` keys that are bench switches, not config fields: `bench_split_in_graph=false` runs flash_split as the
eager autograd Function between two compiled graphs per layer (the code before 2026-12-03's custom op), so the
two can be timed side by side in one process; `bench_cpp_wrapper=true` compiles with inductor's C++ wrapper
(`inductor_cpp_wrapper`); `bench_gdn_per_level=true` runs FLA's public kernel once per trie level in each Gated
DeltaNet layer (`gdn_per_level`, the path before the nineteenth session's one-pass rule, 2026-12-04);
`bench_split_grouped=true` gives every row the split attention's grouped part 2 (`split_grouped`, the plan before
2026-12-05's in-place runs); `bench_merge_compiled=true` merges the split's two parts with torch.compile's kernel
(`merge_compiled`, before 2026-12-05's Triton kernel)."""


@contextlib.contextmanager
def merge_compiled():
    """Bench-only: the split attention's in-place merge runs as torch.compile's kernel of its definition, not
    grpo/kernels/split_merge.py's Triton kernel (grpo/kernels/tree_split.py `MERGE_KERNEL`)."""
    import grpo.kernels.tree_split as tree_split

    before, tree_split.MERGE_KERNEL = tree_split.MERGE_KERNEL, "compiled"
    try:
        yield
    finally:
        tree_split.MERGE_KERNEL = before


@contextlib.contextmanager
def split_grouped():
    """Bench-only: rows are packed with the split attention's grouped part 2 (children's queries gathered per
    parent), never the in-place runs (grpo/trie.py `SPLIT_IN_PLACE`)."""
    import grpo.trie as trie

    before, trie.SPLIT_IN_PLACE = trie.SPLIT_IN_PLACE, False
    try:
        yield
    finally:
        trie.SPLIT_IN_PLACE = before


@contextlib.contextmanager
def gdn_per_level():
    """Bench-only: the Gated DeltaNet kernels are chosen afresh inside without the one-pass rule, so grpo/kernels/gdn.py's
    tree forward calls FLA's public `chunk_gated_delta_rule` once per trie level (`tree_varlen_gated_delta_rule`);
    chosen afresh again after."""
    import grpo.kernels.gdn_choice as gdn_choice

    settle = gdn_choice._settle_one_pass
    gdn_choice._KERNEL_CHOICE.clear()
    gdn_choice._settle_one_pass = lambda kernels, *args: kernels
    try:
        yield
    finally:
        gdn_choice._settle_one_pass = settle
        gdn_choice._KERNEL_CHOICE.clear()


@contextlib.contextmanager
def inductor_cpp_wrapper():
    """Bench-only: torch.compile's generated code launches its kernels from C++ instead of Python
    (`torch._inductor.config.cpp_wrapper`), for a step that waits on the host's launches (small layers). Affects the
    graphs compiled inside; the case builds a fresh policy, so its layers compile under it."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    before = inductor_config.cpp_wrapper
    torch._dynamo.reset()
    inductor_config.cpp_wrapper = True
    try:
        yield
    finally:
        inductor_config.cpp_wrapper = before
        torch._dynamo.reset()


@contextlib.contextmanager
def split_attention_eager():
    """Bench-only: no split plan on the tree context, so `tree_attention_forward` takes its eager path."""
    import grpo.kernels.tree_split as tree_split

    plan_tensors = tree_split.plan_tensors
    tree_split.plan_tensors = lambda row: None
    try:
        yield
    finally:
        tree_split.plan_tensors = plan_tensors


@contextlib.contextmanager
def timed_packing(seconds: list):
    """Bench-only: the host seconds of each `pack_samples` call inside (train_micro_batch's packing of its row,
    before the row's copy to the device) appended to `seconds`."""
    import grpo.trie as trie

    pack = trie.pack_samples

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return pack(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - t0)

    trie.pack_samples = timed
    try:
        yield
    finally:
        trie.pack_samples = pack
