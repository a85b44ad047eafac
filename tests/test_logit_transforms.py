"""Models that transform their logits or attention scores (docs/design.md §7.3): the trainer's packed log-probs and
gradients equal transformers' own forward on Gemma-2 (final + attention soft caps, query_pre_attn_scalar, a sliding
window shorter than the rows) and Granite (logits_scaling), packed == per sample, on every backend that runs on CPU;
the backends that cannot soft-cap are refused; the config reader agrees with each modelling file's forward."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import REPO
from test_tree_attention import random_row_samples

from grpo.logit_transforms import UnsupportedModelError, attention_softcap, head_transform
from grpo.kernels.logprobs import HeadTransform, naive_token_logprobs, policy_token_logprobs
from grpo.policy import PackedPolicy
from grpo.tree_attention import select_backend
from grpo.trie import pack_samples

TEMPERATURE = 0.7


@pytest.fixture(scope="session")
def transform_models():
    from make_tiny_model import LOGIT_TRANSFORM_KINDS, make

    return make(REPO / ".tiny", LOGIT_TRANSFORM_KINDS)


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")


def model_logprobs(model, samples, temperature=TEMPERATURE) -> list[torch.Tensor]:
    """Per sample, log p of each trained token from the model's own forward at `temperature`."""
    out = []
    for s in samples:
        ids = torch.tensor(s.input_ids, device=model.device)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0].float() / temperature  # [L, V]
        pos = torch.tensor([i for i, m in enumerate(s.completion_mask) if m and i > 0], device=ids.device)
        out.append(torch.log_softmax(logits[pos - 1], dim=-1).gather(-1, ids[0, pos][:, None])[:, 0])
    return out


def _trainer_logprobs(model, row, backend):
    return PackedPolicy(model, backend, TEMPERATURE)(row).policy_logprobs  # [M]


CASES = [(kind, backend) for kind in ("gemma2", "granite") for backend in ("sdpa", "gathered_sdpa", "flash_split")
         if not (kind == "gemma2" and backend == "flash_split")]


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("kind, backend", CASES)
def test_packed_logprobs_and_grads_equal_transformers(transform_models, kind, backend, share):
    ref_model, tree_model = _load(transform_models[kind]), _load(transform_models[kind])
    samples = random_row_samples(random.Random(7), "shared_prompt")
    window = getattr(tree_model.config, "sliding_window", None)
    assert window is None or max(len(s.input_ids) for s in samples) > window  # the window cuts in
    row = pack_samples(samples, share_prefixes=share)
    tree = _trainer_logprobs(tree_model, row, backend)
    ref = model_logprobs(ref_model, samples)
    for i, want in enumerate(ref):
        torch.testing.assert_close(tree[row.sample_id == i], want, atol=2e-6, rtol=0)
    sum(r @ torch.full_like(r, s.advantage) for r, s in zip(ref, samples)).backward()
    (tree @ row.advantages).backward()
    for (name, p_ref), p_tree in zip(ref_model.named_parameters(), tree_model.parameters()):
        torch.testing.assert_close(p_tree.grad, p_ref.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", ["gemma2", "granite"])
def test_flex_logprobs_equal_transformers(transform_models, kind):
    """FlexAttention (the soft-capping backend auto picks on CUDA) runs forward-only on CPU: values only here."""
    model = _load(transform_models[kind])
    samples = random_row_samples(random.Random(3), "multi_turn")
    row = pack_samples(samples)
    with torch.no_grad():
        tree = _trainer_logprobs(model, row, "flex")
        ref = model_logprobs(model, samples)
    for i, want in enumerate(ref):
        torch.testing.assert_close(tree[row.sample_id == i], want, atol=2e-6, rtol=0)


def test_the_tiny_models_transforms_bite(transform_models):
    """Without its caps (or its scaling) each tiny model's log-probs move by far more than the tests' tolerance,
    so the tests above would catch a trainer that skips one."""
    samples = random_row_samples(random.Random(7), "shared_prompt")
    for kind, fields in (("gemma2", ("final_logit_softcapping", "attn_logit_softcapping")),
                         ("granite", ("logits_scaling",))):
        for name in fields:
            model = _load(transform_models[kind])
            with torch.no_grad():
                want = torch.cat(model_logprobs(model, samples))
                setattr(model.config, name, None if kind == "gemma2" else 1.0)
                if name == "attn_logit_softcapping":  # read once by each attention layer at init
                    for layer in model.model.layers:
                        layer.self_attn.attn_logit_softcapping = None
                got = torch.cat(model_logprobs(model, samples))
            assert (got - want).abs().max() > 0.05, (kind, name)


def test_backends_that_cannot_soft_cap_are_refused(transform_models):
    model = _load(transform_models["gemma2"])
    assert attention_softcap(model) == 1.0 and attention_softcap(_load(transform_models["granite"])) is None
    assert select_backend("auto", "cpu", softcap=True) == "sdpa"
    for backend in ("flash_split", "flash_varlen"):
        with pytest.raises(UnsupportedModelError, match="cannot soft-cap attention logits.*attn_backend=auto"):
            select_backend(backend, "cpu", softcap=True)
    row = pack_samples(random_row_samples(random.Random(1), "shared_prompt"))
    with pytest.raises(UnsupportedModelError, match="cannot soft-cap"):
        _trainer_logprobs(model, row, "flash_split")


def _tiny(config_cls, model_cls, **fields):
    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=128, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    return model_cls(config_cls(**small, **fields)).eval()


def _reader_cases():
    import transformers as tf

    return {"cohere": (tf.CohereConfig, tf.CohereForCausalLM, dict(logit_scale=0.3)),
            "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM, dict(logit_scale=0.3)),
            "hyperclovax": (tf.HyperCLOVAXConfig, tf.HyperCLOVAXForCausalLM, dict(logits_scaling=0.3)),
            "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, dict(logits_scaling=3.0)),
            "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, dict(final_logit_softcapping=0.5, head_dim=32)),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32))}


@pytest.mark.parametrize("name", ["cohere", "cohere2", "hyperclovax", "granite", "gemma2", "qwen3"])
def test_head_transform_reproduces_the_model_head(name):
    """The reader's transform on h·Wᵀ gives the model's own logits (HyperCLOVAX multiplies by the `logits_scaling`
    Granite divides by), and is the identity where the model does nothing."""
    config_cls, model_cls, fields = _reader_cases()[name]
    model = _tiny(config_cls, model_cls, **fields)
    ids = torch.randint(0, 128, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        got = head_transform(model).apply(model.model(ids).last_hidden_state @ model.lm_head.weight.T)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert head_transform(model).is_identity == (name == "qwen3")


def test_unknown_logit_transforms_are_refused():
    import transformers as tf

    model = _tiny(tf.Qwen3Config, tf.Qwen3ForCausalLM, head_dim=32)
    model.config.logits_scaling = 3.0  # a field whose direction depends on the model type
    with pytest.raises(UnsupportedModelError, match=r"logits_scaling=3.0.*_MULTIPLIERS"):
        head_transform(model)
    model.config.logits_scaling = 1.0
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(128))
    with pytest.raises(UnsupportedModelError, match="LM head has a bias"):
        head_transform(model)


def test_attention_sinks_and_non_causal_layers_are_refused():
    from grpo.tree_attention import TreeContext, _tree_attention_eager

    row = pack_samples(random_row_samples(random.Random(1), "shared_prompt"))
    q = torch.zeros(1, 2, row.num_tokens, 8)
    with pytest.raises(UnsupportedModelError, match="attention sinks"):
        _tree_attention_eager(torch.nn.Module(), q, q, q, None, tree_context=TreeContext(row, "sdpa"),
                              s_aux=torch.zeros(2))
    bidirectional = torch.nn.Module()
    bidirectional.is_causal = False
    with pytest.raises(UnsupportedModelError, match="non-causal"):
        _tree_attention_eager(bidirectional, q, q, q, None, tree_context=TreeContext(row, "sdpa"))


@pytest.mark.parametrize("transform", [HeadTransform(0.25), HeadTransform(1.0, 1.5), HeadTransform(2.0, 3.0)])
@pytest.mark.parametrize("masked", [False, True])
def test_chunked_head_with_transform_equals_naive(transform, masked):
    """The chunked head (kept logits or recomputed, with and without a sampling mask) against plain autograd
    through the transform, float64."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = (2 * torch.randn(50, 16, dtype=torch.float64, generator=g)).requires_grad_()
    targets = torch.randint(0, 50, (13,), generator=g)
    top_ids = torch.randint(0, 50, (13, 3), generator=g)
    mask = torch.cat([targets[:, None], torch.randint(-1, 50, (13, 5), generator=g)], 1) if masked else None
    want = naive_token_logprobs(hidden, weight, targets, 0.8, top_ids, mask, transform=transform)
    want_grads = torch.autograd.grad(want[0].sum(), (hidden, weight))
    for keep in (0, 1 << 20):
        got = policy_token_logprobs(hidden, weight, targets, 0.8, top_ids, mask, chunk_size=4,
                                    keep_logits_bytes=keep, transform=transform)
        torch.testing.assert_close(got[0], want[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(got[1], want[1], atol=1e-12, rtol=0)
        torch.testing.assert_close(got[2], want[2], atol=1e-12, rtol=0)
        for a, b in zip(torch.autograd.grad(got[0].sum(), (hidden, weight)), want_grads):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_ordinary_forward_after_install_keeps_caps_and_window(transform_models):
    """A model switched to `grpo_tree` still runs its ordinary forward exactly (no tree row: the fallback), with
    the attention soft cap and the sliding window that SDPA alone would drop."""
    from grpo.tree_attention import install_tree_attention

    eager, switched = _load(transform_models["gemma2"]), _load(transform_models["gemma2"])
    install_tree_attention(switched)
    ids = torch.randint(10, 1000, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(switched(input_ids=ids).logits, eager(input_ids=ids).logits, atol=2e-6, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["gemma2", "granite"])
def test_gpu_auto_backend_equals_transformers(transform_models, kind):
    """On CUDA, auto picks compiled flex for the soft-capped model (the flash kernels have no cap) and the split
    flash attention for Granite; log-probs and gradients against transformers' eager forward on the same GPU
    (flash runs attention in bf16, hence its looser bound), and the start-up probe passes."""
    from grpo.model_check import check_logprob_path

    ref_model, tree_model = _load(transform_models[kind]).cuda(), _load(transform_models[kind]).cuda()
    backend = select_backend("auto", "cuda", softcap=attention_softcap(tree_model) is not None)
    assert (backend == "flex") == (kind == "gemma2")
    samples = random_row_samples(random.Random(7), "shared_prompt")
    row = pack_samples(samples).to("cuda")
    tree = _trainer_logprobs(tree_model, row, backend)
    ref = model_logprobs(ref_model, samples)
    atol = 1e-4 if backend == "flex" else 3e-2
    for i, want in enumerate(ref):
        torch.testing.assert_close(tree[row.sample_id == i], want, atol=atol, rtol=0)
    sum(r @ torch.full_like(r, s.advantage) for r, s in zip(ref, samples)).backward()
    (tree @ row.advantages).backward()
    for (name, p_ref), p_tree in zip(ref_model.named_parameters(), tree_model.parameters()):
        torch.testing.assert_close(p_tree.grad, p_ref.grad, atol=10 * atol, rtol=1e-2, msg=name)
    tree_model.zero_grad(set_to_none=True)
    assert check_logprob_path(tree_model, PackedPolicy(tree_model, backend, TEMPERATURE)).passed
