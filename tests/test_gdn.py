"""Tree-packed Gated DeltaNet (grpo/gdn.py) against the unpacked transformers layer, sample by sample.

The reference is transformers' own `Qwen3_5GatedDeltaNet.forward` run on each sample alone; the packed row comes
from `grpo.trie.pack_samples`. The layer under test gets weights scaled up from the tiny checkpoint's 0.02 init
and slow decays, so that history (conv taps and recurrent state carried across segment boundaries) visibly
changes the output: `test_parent_state_matters` checks the comparison would catch a dropped parent state.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from grpo.gdn import (conv_index_table, plan_tree_scan, segment_levels, tree_causal_conv1d,
                      tree_chunk_gated_delta_rule, tree_gdn_forward)
from grpo.samples import TrainingSample
from grpo.trie import pack_samples

TOL = dict(atol=1e-5, rtol=1e-4)


def _sample(tokens: list[int]) -> TrainingSample:
    return TrainingSample(input_ids=tokens, completion_mask=[1] * len(tokens), sampler_logprobs=[0.0] * len(tokens),
                          advantage=1.0, group_id=0, model_version=0)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 1000) for _ in range(n)]


def shared_prompt(rng: random.Random) -> list[list[int]]:
    """One long prompt (crosses a 64-token chunk) and 4 divergent completions, one a prefix-equal duplicate."""
    prompt = _tokens(rng, 70)
    completions = [_tokens(rng, rng.randrange(1, 20)) for _ in range(3)]
    return [prompt + c for c in completions] + [prompt + completions[0]]


def multi_level(rng: random.Random) -> list[list[int]]:
    """Each new sample forks a random earlier one at a random depth: a segment tree several levels deep."""
    samples = [_tokens(rng, 30)]
    for _ in range(7):
        base = rng.choice(samples)
        samples.append(base[:rng.randrange(1, len(base))] + _tokens(rng, rng.randrange(2, 25)))
    return samples


def nothing_shared(rng: random.Random) -> list[list[int]]:
    return [_tokens(rng, n) for n in (5, 1, 80, 17)]


TRIES = {"shared_prompt": shared_prompt, "multi_level": multi_level, "nothing_shared": nothing_shared}


@pytest.fixture(scope="module")
def gdn_layer(tiny_models):
    """A real Qwen3.5 GDN layer (tiny config: 2 key heads, 4 value heads, head dim 32, conv kernel 4)."""
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    text_config = AutoConfig.from_pretrained(tiny_models["qwen3_5"]).text_config
    layer = Qwen3_5GatedDeltaNet(text_config, layer_idx=0).float()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name == "A_log":  # decays exp(g) in about [0.75, 1): state survives across segments
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.3, generator=gen).log())
            elif name == "dt_bias":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5 - 1.0)
            elif name == "norm.weight":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return layer


def _per_sample_reference(layer, packed_hidden, paths):
    """Each sample alone through the unmodified layer; its input is the packed input gathered along its path."""
    return [layer(packed_hidden[path][None])[0] for path in paths]  # each [L_s, hidden]


def _weighted_loss(outputs, weights):
    return sum((out * w).sum() for out, w in zip(outputs, weights))


@pytest.mark.parametrize("kind", list(TRIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_gdn_layer_matches_per_sample(gdn_layer, kind, seed):
    rng = random.Random(seed)
    row = pack_samples([_sample(t) for t in TRIES[kind](rng)])
    paths = row.sample_paths()
    torch.manual_seed(seed)
    packed_hidden = torch.randn(row.num_tokens, gdn_layer.hidden_size, requires_grad=True)  # [N, hidden]
    weights = [torch.randn(len(p), gdn_layer.hidden_size) for p in paths]

    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, gdn_layer.conv_kernel_size)
    packed_out = tree_gdn_forward(gdn_layer, packed_hidden[None], plan)[0]  # [N, hidden]
    packed_grads = torch.autograd.grad(_weighted_loss([packed_out[p] for p in paths], weights),
                                       [packed_hidden, *gdn_layer.parameters()])

    reference_out = _per_sample_reference(gdn_layer, packed_hidden, paths)
    reference_grads = torch.autograd.grad(_weighted_loss(reference_out, weights),
                                          [packed_hidden, *gdn_layer.parameters()])

    for path, ref in zip(paths, reference_out):
        torch.testing.assert_close(packed_out[path], ref, **TOL)
    names = ["hidden_states"] + [n for n, _ in gdn_layer.named_parameters()]
    for name, got, want in zip(names, packed_grads, reference_grads):
        _assert_close_to_scale(got, want, f"grad of {name}")


def _assert_close_to_scale(got, want, what, tol=1e-5):
    """Max error relative to the tensor's own scale: gradients sum many tokens, so their entries reach O(10)."""
    scale = want.abs().max().clamp(min=1.0)
    error = (got - want).abs().max() / scale
    assert error <= tol, f"{what}: max error {error:.2e} x scale {scale:.2e} (tolerance {tol:.0e})"


def test_parent_state_matters(gdn_layer):
    """Sensitivity of the comparison above: forgetting the parent's state and conv inputs is far out of tolerance."""
    row = pack_samples([_sample(t) for t in shared_prompt(random.Random(0))])
    hidden = torch.randn(1, row.num_tokens, gdn_layer.hidden_size)
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, gdn_layer.conv_kernel_size)
    starts = row.cu_seqlens_q[:-1].long()
    orphan_pred = row.token_pred.clone()
    orphan_pred[starts] = -1
    orphan_plan = plan_tree_scan(orphan_pred, row.cu_seqlens_q, torch.full_like(row.seg_parent, -1),
                                 gdn_layer.conv_kernel_size)
    with torch.no_grad():
        diff = (tree_gdn_forward(gdn_layer, hidden, plan) - tree_gdn_forward(gdn_layer, hidden, orphan_plan)).abs()
    child_tokens = torch.arange(int(row.cu_seqlens_q[1]), row.num_tokens)
    assert diff[0, child_tokens].max() > 1e-2
    assert diff[0, :int(row.cu_seqlens_q[1])].max() == 0


def test_conv_index_table_walks_each_path():
    row = pack_samples([_sample(t) for t in multi_level(random.Random(3))])
    table = conv_index_table(row.token_pred, 4)  # [N, 4]
    for path in row.sample_paths():
        padded = torch.cat([torch.full((3,), row.num_tokens), path])  # causal zero padding = index N
        windows = padded.unfold(0, 4, 1)  # [L, 4]: window i = path[i-3 .. i]
        torch.testing.assert_close(table[path], windows)


def test_tree_conv_gradcheck():
    """The custom backward of the depthwise tree conv against finite differences (float64)."""
    row = pack_samples([_sample(t) for t in multi_level(random.Random(4))][:4])
    index = conv_index_table(row.token_pred, 4)
    x = torch.randn(row.num_tokens, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: tree_causal_conv1d(a, w, None, "silu", index), (x, weight))


def test_levels_bound_sequential_launches(gdn_layer):
    """One chunked call per segment-tree level, however many segments."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    row = pack_samples([_sample(t) for t in multi_level(random.Random(5))])
    depth = max(segment_levels(row.seg_parent.tolist())) + 1
    assert row.num_segments > depth
    calls = []

    def counting_rule(*args, **kwargs):
        calls.append(args[0].shape[0])
        return torch_chunk_gated_delta_rule(*args, **kwargs)

    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    n, h, d = row.num_tokens, gdn_layer.num_v_heads, gdn_layer.head_k_dim
    tree_chunk_gated_delta_rule(counting_rule, torch.randn(n, h, d), torch.randn(n, h, d), torch.randn(n, h, d),
                                -torch.rand(n, h), torch.rand(n, h), plan)
    assert len(calls) == depth and sum(calls) == row.num_segments


@pytest.fixture(scope="module")
def qwen35_pair(tiny_models):
    """(unpatched, patched) copies of the tiny Qwen3.5 VLM with weights large enough for logprobs to vary."""
    from transformers import Qwen3_5ForConditionalGeneration

    from grpo.gdn import patch_gdn_layers

    model = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_models["qwen3_5"], dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.3, generator=gen).log())
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        model.lm_head.weight.mul_(10)
    patched = copy.deepcopy(model)
    assert patch_gdn_layers(patched) == 3
    assert patch_gdn_layers(patched) == 3  # idempotent
    return model, patched


def _unpacked_logprobs(model, samples: list[list[int]]) -> torch.Tensor:
    """Per-sample ordinary forwards; the log-prob of every token i >= 1, samples concatenated (the row's order)."""
    out = []
    for tokens in samples:
        ids = torch.tensor(tokens)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]  # [L-1, V]
        out.append(logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0])
    return torch.cat(out)  # [M]


def _packed_logprobs(model, row) -> torch.Tensor:
    from grpo.tree_attention import forward_hidden, lm_head_weight

    hidden = forward_hidden(model, row, backend="sdpa")  # [N, hidden]
    logits = hidden[row.token_index] @ lm_head_weight(model).T  # [M, V]
    return logits.log_softmax(-1).gather(-1, row.targets[:, None])[:, 0]  # [M]


@pytest.mark.parametrize("kind", list(TRIES))
@pytest.mark.parametrize("checkpointing", [False, True])
def test_model_logprobs_match_unpacked(qwen35_pair, kind, checkpointing):
    """Whole hybrid model (3 GDN layers + 1 full-attention layer): packed logprobs and their gradients equal the
    per-sample forwards of the unpatched model; with gradient checkpointing the GDN layers re-run in backward."""
    reference_model, patched = qwen35_pair
    samples = TRIES[kind](random.Random(7))
    row = pack_samples([_sample(t) for t in samples])
    if checkpointing:
        patched.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        patched.train()
    try:
        packed = _packed_logprobs(patched, row)
        weights = torch.randn(packed.shape, generator=torch.Generator().manual_seed(2))
        params = [p for _, p in patched.model.language_model.named_parameters()]
        packed_grads = torch.autograd.grad((packed * weights).sum(), params)
    finally:
        patched.gradient_checkpointing_disable()
        patched.eval()
    reference = _unpacked_logprobs(reference_model, samples)
    reference_params = [p for _, p in reference_model.model.language_model.named_parameters()]
    reference_grads = torch.autograd.grad((reference * weights).sum(), reference_params)

    assert reference.std() > 0.1  # logprobs vary: the comparison is not between near-uniform distributions
    torch.testing.assert_close(packed, reference, atol=2e-5, rtol=1e-5)
    names = [n for n, _ in patched.model.language_model.named_parameters()]
    for name, got, want in zip(names, packed_grads, reference_grads):
        _assert_close_to_scale(got, want, f"grad of {name}", tol=2e-5)


def test_patched_model_without_row_is_unchanged(qwen35_pair):
    reference_model, patched = qwen35_pair
    ids = torch.tensor([_tokens(random.Random(9), 40)])
    with torch.no_grad():
        torch.testing.assert_close(patched(input_ids=ids).logits, reference_model(input_ids=ids).logits,
                                   atol=0, rtol=0)
