"""A stand-in `fla` (flash-linear-attention) whose kernels raise: tests put tests/fla_stub on sys.path (in a
subprocess) to prove that a code path never reaches FLA although `fla` is importable. transformers binds its
Qwen3.5 `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` to these when it imports the model."""

__version__ = "0.0.0+stub"
