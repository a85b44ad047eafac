"""Tied embeddings through a real weight sync, and the sync probe that catches a server left on other weights.

References: a float32 transformers forward of the trainer's own model (the server must compute the same log-probs
after every sync), and a stale server built by really skipping a tensor in a sync (vLLM keeps that layer's old
weights), which the probe must catch and name."""

from __future__ import annotations

import pytest
import torch

from grpo.sync_probe import SyncProbe, SyncProbeError, most_changed, probe_tokens, tied_names, trainer_logprobs
from grpo.weight_sync import WeightSync, WeightSyncConfig

STEPS = 10


def load(model_dir):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def train_steps(model, optimizer, n: int, seed: int) -> None:
    """`n` real optimizer steps of next-token loss on random ids: every tensor moves, the tied embedding too."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(4, model.config.vocab_size, (2, 24), generator=generator)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


# ---- pure ---------------------------------------------------------------------------------------------------------
def test_probe_tokens_stay_in_the_vocabulary_and_vary():
    tokens = probe_tokens(1024)
    assert len(tokens) == 16 and all(0 <= t < 1024 for t in tokens) and len(set(tokens)) == 16


def test_tied_names_and_most_changed(tiny_models):
    from make_tiny_model import make

    tied = load(make(tiny_models["qwen3"].parent, ("qwen3_tied",))["qwen3_tied"])
    assert tied_names(tied) == ["model.embed_tokens.weight = lm_head.weight"]
    assert tied_names(load(tiny_models["qwen3"])) == []
    ranked = most_changed({"a": 1.0, "b": 2.0, "c": 4.0}, {"a": 1.01, "b": 3.0, "c": 4.0})
    assert [r.split(" ")[0] for r in ranked] == ["b", "a"]  # c did not move


class ServingModel:
    """The server side of the probe route for a model held here (a real forward, not a recorded answer)."""

    def __init__(self, model):
        self.model = model

    def served_model_name(self):
        return "m"

    def prompt_logprobs(self, name, tokens):
        return trainer_logprobs(self.model, tokens).tolist()


class Session:
    """What SyncProbe reads of a WeightSync: rank, servers, transport name, plan."""

    rank, adapter, plan = 0, None, None
    urls = ["http://s0"]

    def __init__(self, served):
        self.controls = [ServingModel(served)]
        self.transport = type("T", (), {"name": "cpu_file"})()

    def alive(self):
        return [0]


def test_probe_passes_on_equal_weights_and_names_the_stale_tensor(tiny_qwen3):
    trainer = load(tiny_qwen3)
    served = load(tiny_qwen3)
    probe = SyncProbe(every=2)
    metrics = probe.after_sync(Session(served), trainer, 1)
    assert metrics["sampling/sync_check_max_logp_diff"] < 1e-5 and metrics["sampling/sync_checks"] == 1
    assert probe.after_sync(Session(served), trainer, 2) == {}  # not due: every 2 syncs
    stale = "model.layers.1.mlp.down_proj.weight"
    with torch.no_grad():
        for name, param in trainer.named_parameters():
            param.mul_(1.5 if name == stale else 1.01)  # the trainer moves on; the served model keeps `stale` ...
            if name != stale:
                served.get_parameter(name).copy_(param)  # ... and receives everything else
    with pytest.raises(SyncProbeError, match=f"(?s)version 3 \\(cpu_file to http://s0\\).*{stale} \\(0.5\\)"):
        probe.after_sync(Session(served), trainer, 3)


def test_a_server_that_does_not_answer_the_probe_is_counted_not_fatal(tiny_qwen3):
    import httpx

    class Down(ServingModel):
        def prompt_logprobs(self, name, tokens):
            raise httpx.ConnectError("connection refused")

    session = Session(load(tiny_qwen3))
    session.controls = [Down(None)]
    metrics = SyncProbe(every=1).after_sync(session, load(tiny_qwen3), 1)
    assert metrics["sampling/sync_check_unanswered"] == 1 and metrics["sampling/sync_checks"] == 0


# ---- a real vLLM CPU server ---------------------------------------------------------------------------------------
@pytest.mark.vllm
def test_tied_embedding_sync_matches_and_a_skipped_tensor_is_caught(tiny_models, tmp_path):
    """A tied Qwen3 trained between syncs: after each of STEPS cpu_file syncs the server's prompt log-probs equal the
    trainer's (float32 floor) and the probe passes; then a sync that skips one tensor is caught by the probe."""
    from conftest import start_server
    from make_tiny_model import make

    model_dir = make(tiny_models["qwen3"].parent, ("qwen3_tied",))["qwen3_tied"]
    server = start_server(model_dir, tmp_path)
    try:
        model = load(model_dir)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
        sync = WeightSync(server.base_url, WeightSyncConfig(mode="cpu_file", timeout=120.0))
        sync.probe = SyncProbe(every=1)
        sync.init(model)
        tokens = probe_tokens(model.config.vocab_size)
        embedding = model.model.embed_tokens.weight.detach().clone()
        gaps = []
        for version in range(1, STEPS + 1):
            train_steps(model, optimizer, 2, seed=version)
            metrics = sync.sync(model, version)
            served = torch.tensor(sync.control.prompt_logprobs(str(model_dir), tokens))
            gaps.append(float((served - trainer_logprobs(model, tokens)).abs().max()))
            assert metrics["sampling/sync_checks"] == version
        assert (model.model.embed_tokens.weight - embedding).abs().max() > 1e-2  # the embedding did move
        assert max(gaps) < 1e-4, gaps

        stale = "model.layers.0.mlp.down_proj.weight"  # a layer of its own: vLLM keeps its old weight
        send_all = sync.plan.iter_tensors
        sync.plan.iter_tensors = lambda *a, **k: ((n, t) for n, t in send_all(*a, **k) if n != stale)
        with torch.no_grad():
            model.get_parameter(stale).mul_(3.0)
        with pytest.raises(SyncProbeError, match=f"(?s)cpu_file to {server.base_url}.*{stale}"):
            sync.sync(model, STEPS + 1)
        sync.close()
    finally:
        server.stop()
