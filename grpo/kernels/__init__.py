"""Kernels a researcher never edits: Gated DeltaNet's tree scan (gdn*.py), the split tree attention
(tree_split.py, split_merge.py) and the chunked log-prob head (logprobs.py). The flat grpo/ modules call them
through the names below; tests and benchmarks may reach into the submodules.

Layering (tests/test_import_graph.py): nothing here imports a flat research module, only the packed-row data
(grpo/trie.py), the shared row context (grpo/row_context.py) and the progress heartbeat (grpo/progress.py).
A deferred import reads its submodule instead (`from grpo.kernels.tree_split import plan_tensors`): it must see
what a benchmark switch (scripts/bench_patches.py) or a test patched there, not the name bound here at import."""

from grpo.kernels.gdn import compile_chunk_regions, compile_tree_conv, is_gdn_layer, patch_gdn_layers
from grpo.kernels.gdn_graph import compile_gdn_mixer, mixer_weights
from grpo.kernels.logprobs import policy_token_logprobs
from grpo.kernels.tree_split import plan_tensors, repeat_kv, split_attention, split_attention_in_graph, varlen_mask

__all__ = ["compile_chunk_regions", "compile_gdn_mixer", "compile_tree_conv", "is_gdn_layer", "mixer_weights",
           "patch_gdn_layers", "plan_tensors", "policy_token_logprobs", "repeat_kv", "split_attention",
           "split_attention_in_graph", "varlen_mask"]
