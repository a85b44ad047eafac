"""Tree-packed forward == per-sample unpacked forward (docs/design.md §7.1), values and parameter gradients.

The reference is an independent model instance with transformers' own eager attention, fed one sample at a time
with ordinary positions; the packed side goes through `forward_hidden` with each backend.
"""

from __future__ import annotations

import random

import pytest
import torch

import grpo.tree_attention as ta
from grpo.samples import TrainingSample
from grpo.tree_attention import ACTIVE_ROW, forward_hidden, lm_head_weight, select_backend
from grpo.trie import pack_samples


def _sample(ids, rng, group=0, train_prob=0.8):
    mask = [0] + [int(rng.random() < train_prob) for _ in ids[1:]]
    return TrainingSample(input_ids=list(ids), completion_mask=mask, sampler_logprobs=[0.0] * len(ids),
                          advantage=rng.uniform(-1, 1), group_id=group, model_version=0)


def random_row_samples(rng: random.Random, kind: str, vocab: int = 1000) -> list[TrainingSample]:
    """Samples that share a prompt, share multi-turn prefixes, or share nothing. Completions draw from a few
    tokens so rollouts of a group often agree for a while and fork later (and may be exact duplicates)."""
    def toks(n, lo=10, hi=vocab):
        return [rng.randrange(lo, hi) for _ in range(n)]

    samples = []
    if kind == "shared_prompt":
        for g in range(rng.randint(1, 3)):
            prompt = toks(rng.randint(1, 12))
            for _ in range(rng.randint(1, 5)):
                samples.append(_sample(prompt + toks(rng.randint(1, 8), 10, 14), rng, g))
    elif kind == "multi_turn":
        system = toks(4)
        for g in range(2):
            convo = system + toks(rng.randint(1, 6))
            for _ in range(rng.randint(1, 4)):
                convo = convo + toks(rng.randint(1, 6), 10, 13)
                fork = convo[: rng.randint(1, len(convo))] + toks(rng.randint(1, 4))
                samples.append(_sample(convo, rng, g))
                samples.append(_sample(fork, rng, g))
    else:
        samples = [_sample(toks(rng.randint(1, 15)), rng, g) for g in range(rng.randint(1, 5))]
    return samples


def reference_logprobs(model, samples) -> list[torch.Tensor]:
    """Per sample, logprob of every trained token from an ordinary unpacked forward."""
    out = []
    for s in samples:
        ids = torch.tensor(s.input_ids)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0].float()  # [L, V]
        pos = torch.tensor([i for i, m in enumerate(s.completion_mask) if m and i > 0], dtype=torch.long)
        logp = torch.log_softmax(logits[pos - 1], dim=-1)
        out.append(logp.gather(-1, ids[0, pos][:, None])[:, 0])
    return out


def packed_logprobs(model, row, backend) -> torch.Tensor:
    hidden = forward_hidden(model, row, backend)  # [N, H]
    logits = hidden[row.token_index.to(hidden.device)].float() @ lm_head_weight(model).float().T  # [M, V]
    return torch.log_softmax(logits, -1).gather(-1, row.targets.to(hidden.device)[:, None])[:, 0]


def _load(path, dtype=torch.float32, device="cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device)


@pytest.fixture(scope="module")
def qwen3_pair(tiny_qwen3):
    return _load(tiny_qwen3), _load(tiny_qwen3)


@pytest.fixture(scope="module")
def moe_pair(tiny_models):
    return _load(tiny_models["qwen3_moe"]), _load(tiny_models["qwen3_moe"])


def _compare(ref_model, tree_model, samples, backend, share=True, atol=1e-5, grad_atol=1e-4, grads=True):
    row = pack_samples(samples, share_prefixes=share)
    with torch.set_grad_enabled(grads):
        ref = reference_logprobs(ref_model, samples)
        tree = packed_logprobs(tree_model, row, backend)
    by_sample = [tree[row.sample_id == s] for s in range(len(samples))]
    for r, t in zip(ref, by_sample):
        torch.testing.assert_close(t, r, atol=atol, rtol=0)
    if not grads:
        return row
    # gradients of sum(logprob x advantage) over trained tokens
    for m in (ref_model, tree_model):
        m.zero_grad(set_to_none=True)
    sum(r @ torch.full_like(r, s.advantage) for r, s in zip(ref, samples)).backward()
    (tree @ row.advantages).backward()
    for (name, p_ref), p_tree in zip(ref_model.named_parameters(), tree_model.parameters()):
        if p_ref.grad is None:
            assert p_tree.grad is None or p_tree.grad.abs().max() == 0, name
            continue
        torch.testing.assert_close(p_tree.grad, p_ref.grad, atol=grad_atol, rtol=1e-3, msg=name)
    return row


@pytest.mark.parametrize("backend", ["sdpa", "gathered_sdpa", "flash_split", "flex"])
@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn", "nothing_shared"])
def test_tree_forward_matches_unpacked_qwen3(qwen3_pair, backend, kind):
    rng = random.Random(hash((backend, kind)) % 1000)
    for _ in range(3):
        samples = random_row_samples(rng, kind)
        if not any(s.num_trained for s in samples):
            continue
        # FlexAttention has no CPU backward (torch 2.13); its gradients are checked by the GPU test
        row = _compare(*qwen3_pair, samples, backend, grads=backend != "flex")
        if kind == "shared_prompt":
            assert row.num_tokens <= row.num_raw_tokens


def test_plain_packing_matches_unpacked(qwen3_pair):
    rng = random.Random(7)
    samples = random_row_samples(rng, "shared_prompt")
    row = _compare(*qwen3_pair, samples, "sdpa", share=False)
    assert row.num_tokens == row.num_raw_tokens


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_turn"])
def test_tree_forward_matches_unpacked_moe(moe_pair, kind):
    rng = random.Random(3)
    _compare(*moe_pair, random_row_samples(rng, kind), "sdpa")


def test_active_row_is_set_only_during_forward(qwen3_pair, monkeypatch):

    seen = []
    inner = ta._BACKEND_FN["sdpa"]
    monkeypatch.setitem(ta._BACKEND_FN, "sdpa", lambda ctx, *a: (seen.append(ACTIVE_ROW.get()), inner(ctx, *a))[1])
    row = pack_samples(random_row_samples(random.Random(0), "shared_prompt"))
    forward_hidden(qwen3_pair[1], row, "sdpa")
    assert seen and all(r is not None and torch.equal(r.input_ids, row.input_ids) for r in seen)
    assert ACTIVE_ROW.get() is None


def test_select_backend_cpu():
    assert select_backend("auto", "cpu") == "sdpa"
    with pytest.raises(RuntimeError, match="flash_varlen"):
        select_backend("flash_varlen", "cpu")
    with pytest.raises(ValueError, match="unknown"):
        select_backend("nope", "cpu")


def test_select_backend_auto_on_cuda(monkeypatch):
    """auto on a GPU: flash_split where torch's FlashAttention ops run, else flash_varlen; asking for flash_split
    where they do not raises with the alternatives named (availability stubbed: this machine has no GPU)."""
    monkeypatch.setattr(ta, "_split_available", lambda device: True)
    assert select_backend("auto", "cuda") == "flash_split"
    monkeypatch.setattr(ta, "_split_available", lambda device: False)
    monkeypatch.setattr(ta, "_torch_varlen", lambda: object())
    assert select_backend("auto", "cuda") == "flash_varlen"
    with pytest.raises(RuntimeError, match="flash_varlen"):
        select_backend("flash_split", "cuda")


@pytest.mark.gpu
def test_select_backend_auto_on_this_gpu():
    assert select_backend("auto", "cuda") == ("flash_split" if torch.cuda.get_device_capability() >= (8, 0)
                                              else "flash_varlen")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flash_varlen", "flash_split", "flex"])
def test_gpu_backends_match_unpacked_bf16(tiny_qwen3, backend):
    """bf16 on CUDA: each GPU backend against per-sample unpacked forwards of an eager bf16 model, values and
    the direction of the parameter gradient of sum(logprob x advantage)."""
    ref_model = _load(tiny_qwen3, torch.bfloat16, "cuda")
    tree_model = _load(tiny_qwen3, torch.bfloat16, "cuda")
    rng = random.Random(11)
    for kind in ("shared_prompt", "multi_turn", "nothing_shared"):
        samples = random_row_samples(rng, kind)
        row = pack_samples(samples).to("cuda")
        ref_model.zero_grad(set_to_none=True)
        tree_model.zero_grad(set_to_none=True)
        ref = _ref_on(ref_model, samples)
        sum(r.sum() * s.advantage for r, s in zip(ref, samples)).backward()
        tree = packed_logprobs(tree_model, row, backend)
        (tree @ row.advantages).backward()
        order = torch.argsort(row.sample_id, stable=True)
        torch.testing.assert_close(tree[order].detach(), torch.cat(ref).detach(), atol=5e-2, rtol=0)
        g_ref = torch.cat([p.grad.flatten().float() for p in ref_model.parameters()])
        g_tree = torch.cat([p.grad.flatten().float() for p in tree_model.parameters()])
        assert torch.nn.functional.cosine_similarity(g_ref, g_tree, dim=0) > 0.99, kind


def _ref_on(model, samples):
    out = []
    for s in samples:
        ids = torch.tensor(s.input_ids, device="cuda")[None]
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
        pos = torch.tensor([i for i, m in enumerate(s.completion_mask) if m and i > 0], dtype=torch.long,
                           device="cuda")
        out.append(torch.log_softmax(logits[pos - 1], -1).gather(-1, ids[0, pos][:, None])[:, 0])
    return out


def test_qwen3_5_text_stack_single_sample(tiny_models):
    """Qwen3.5 VLM checkpoint: the text decoder is found, M-RoPE rows get the depth, full-attention layers go
    through the tree function. One sample only: its GDN layers are tree-aware only with grpo/kernels/gdn.py."""
    from transformers import AutoModelForImageTextToText

    def load():
        return AutoModelForImageTextToText.from_pretrained(tiny_models["qwen3_5"], dtype=torch.float32,
                                                           attn_implementation="eager")

    ref_model, tree_model = load(), load()
    rng = random.Random(5)
    samples = [_sample([rng.randrange(10, 900) for _ in range(24)], rng)]
    with torch.no_grad():
        ref = reference_logprobs(ref_model, samples)[0]
        tree = packed_logprobs(tree_model, pack_samples(samples), "sdpa")
    torch.testing.assert_close(tree, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind, checkpointing", [("qwen3", "false"), ("qwen3", "true"), ("qwen3_5", "false")])
def test_whole_layer_compile_equals_eager(tiny_models, kind, checkpointing, monkeypatch):
    """`compile_scope="layers"` (grpo/model.py `whole_layers`: dense attention layers compiled whole, attention a graph
    break; Gated DeltaNet layers keep their regions) gives the eager step's tree-packed log-probs and gradients, with
    and without gradient checkpointing, through `build_policy` as train.py calls it (fp32 on CPU)."""
    import dataclasses
    import importlib

    import grpo.kernels.gdn as tree_gdn
    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import DistInfo
    from grpo.model import whole_layers
    from grpo.policy import build_policy
    from test_train import random_samples

    monkeypatch.setattr(tree_gdn, "_COMPILED", {})  # process-wide compile state, put back after the test
    for name in ("qwen3", "qwen3_5"):
        modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    base = AsyncGRPOConfig(model=str(tiny_models[kind]), gradient_checkpointing=checkpointing)
    row = pack_samples(random_samples(5))
    results = []
    for overrides in (dict(compile_layers=False), dict(compile_layers=True, compile_scope="layers")):
        model, policy, *_ = build_policy(dataclasses.replace(base, **overrides), DistInfo(0, 1, 0, torch.device("cpu")),
                                         2048)
        logp = policy(row).policy_logprobs
        (logp @ row.advantages).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        compiled = [layer for layer in whole_layers(model) if getattr(layer, "_compiled_call_impl", None) is not None]
        results.append((logp.detach(), grads, len(compiled), len(whole_layers(model))))
    (eager, eager_grads, none, _), (fast, fast_grads, compiled, eligible) = results
    assert none == 0 and compiled == eligible > 0  # every dense attention layer compiled whole, only in that mode
    torch.testing.assert_close(fast, eager, atol=1e-5, rtol=1e-5)
    assert fast_grads.keys() == eager_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(fast_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_flash_split_stays_inside_the_compiled_layer(tiny_models, monkeypatch):
    """`flash_split` is a custom op with tensor arguments only (grpo/kernels/tree_split.py `split_attention_op`): a layer
    compiled whole calls it inside its graph — no graph break at attention — and rows of new sizes reuse the
    compiled graphs (the row's ints travel in a CPU tensor, not as guards). Log-probs and gradients equal the eager
    split's (the dense reference of FlashAttention's contract on CPU)."""
    import dataclasses
    import importlib

    from torch._dynamo.utils import counters

    import grpo.kernels.gdn as tree_gdn
    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import DistInfo
    from grpo.policy import build_policy
    from test_train import random_samples

    monkeypatch.setattr(tree_gdn, "_COMPILED", {})  # process-wide compile state, put back after the test
    for name in ("qwen3", "qwen3_5"):
        modeling = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    base = AsyncGRPOConfig(model=str(tiny_models["qwen3"]), gradient_checkpointing="false", attn_backend="flash_split")
    rows = [pack_samples(random_samples(5))] + [pack_samples(random_row_samples(random.Random(seed), "shared_prompt"))
                                                for seed in (1, 2)]
    assert all(row.anc_max_q > 0 for row in rows)  # every row runs both parts of the split
    results, graphs = [], []
    for overrides in (dict(compile_layers=False), dict(compile_layers=True, compile_scope="layers")):
        model, policy, *_ = build_policy(dataclasses.replace(base, **overrides), DistInfo(0, 1, 0, torch.device("cpu")),
                                         2048)
        counters.clear()
        for row in rows:
            results.append(step_results(model, policy, row))
            graphs.append(counters["stats"]["unique_graphs"])
        breaks = [reason for reason in counters["graph_break"] if "attention" in reason]
    assert not breaks, breaks
    assert graphs[3] > 0 and graphs[4] == graphs[5]  # compiled; the third row (new sizes) compiled nothing new
    assert_same_results(results[3:], results[:3])


def step_results(model, policy, row) -> tuple:
    """(log-probs, gradients by parameter name) of one row's policy-gradient backward; the gradients zeroed after."""
    logp = policy(row).policy_logprobs
    (logp @ row.advantages).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logp.detach(), grads


def assert_same_results(fast: list, eager: list) -> None:
    """`step_results` of a compiled policy == an eager one's, row by row (fp32 on CPU; a gradient within 2e-6 of its
    largest entry: sums over a row's tokens in another order differ by a few fp32 ulps of that scale)."""
    for (eager_logp, eager_grads), (fast_logp, fast_grads) in zip(eager, fast, strict=True):
        torch.testing.assert_close(fast_logp, eager_logp, atol=1e-5, rtol=1e-5)
        assert fast_grads.keys() == eager_grads.keys()
        for name, grad in eager_grads.items():
            atol = max(1e-5, 2e-6 * grad.abs().max().item())
            torch.testing.assert_close(fast_grads[name], grad, atol=atol, rtol=1e-4, msg=name)
