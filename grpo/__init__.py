"""Asynchronous GRPO in plain PyTorch: a rollout worker streams scored samples from a vLLM server while an FSDP2
trainer packs them as prefix tries and trains. See README.md for the file map."""
