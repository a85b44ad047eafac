"""Tree-packed Gated DeltaNet (grpo/kernels/gdn.py) against the unpacked transformers layer, sample by sample, and the
chunked torch kernel against the token-by-token reference.

The layer reference is transformers' own `Qwen3_5GatedDeltaNet.forward` run on each sample alone (without `fla`
installed its recurrence is transformers' torch kernel); the packed row comes from `grpo.trie.pack_samples`. The
layer under test gets weights scaled up from the tiny checkpoint's 0.02 init and slow decays, so that history
(conv taps and recurrent state carried across segment boundaries) visibly changes the output:
`test_parent_state_matters` checks the comparison would catch a dropped parent state. The kernel reference is
`sequential_gated_delta_rule` in fp64. Kernel choice: the rule's matrix, and a subprocess with a stub `fla`
(tests/fla_stub, kernels raise) on sys.path proving the torch path never reaches an importable FLA.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from grpo.kernels.gdn import (CHUNK, GdnKernels, choose_gdn_kernels, chunk_gated_delta_rule, conv_fix_index,
                              conv_index_table, fla_directions, plan_tree_scan, segment_levels,
                              sequential_gated_delta_rule, tree_causal_conv1d, tree_chunk_gated_delta_rule,
                              tree_gdn_forward, tree_varlen_gated_delta_rule, unit_lower_inverse)
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


def _check_layer_against_per_sample(layer, kind: str, seed: int) -> None:
    """tree_gdn_forward on a packed row == the unmodified layer on each sample alone: values and the gradients of
    the input and every parameter."""
    row = pack_samples([_sample(t) for t in TRIES[kind](random.Random(seed))])
    paths = row.sample_paths()
    torch.manual_seed(seed)
    packed_hidden = torch.randn(row.num_tokens, layer.hidden_size, requires_grad=True)  # [N, hidden]
    weights = [torch.randn(len(p), layer.hidden_size) for p in paths]

    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, layer.conv_kernel_size)
    packed_out = tree_gdn_forward(layer, packed_hidden[None], plan)[0]  # [N, hidden]
    packed_grads = torch.autograd.grad(_weighted_loss([packed_out[p] for p in paths], weights),
                                       [packed_hidden, *layer.parameters()])

    reference_out = _per_sample_reference(layer, packed_hidden, paths)
    reference_grads = torch.autograd.grad(_weighted_loss(reference_out, weights),
                                          [packed_hidden, *layer.parameters()])

    for path, ref in zip(paths, reference_out):
        torch.testing.assert_close(packed_out[path], ref, **TOL)
    names = ["hidden_states"] + [n for n, _ in layer.named_parameters()]
    for name, got, want in zip(names, packed_grads, reference_grads):
        _assert_close_to_scale(got, want, f"grad of {name}")


@pytest.mark.parametrize("kind", list(TRIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_gdn_layer_matches_per_sample(gdn_layer, kind, seed):
    _check_layer_against_per_sample(gdn_layer, kind, seed)


@pytest.mark.parametrize("kind", ["shared_prompt", "multi_level"])
def test_fla_path_normalises_query_and_key_in_the_conv(gdn_layer, kind, monkeypatch):
    """Where FLA runs the recurrence, the layer passes it query and key already L2-normalised by the tree conv
    (`qk_norm`) with `use_qk_l2norm_in_kernel=False`: FLA launches no normalisation kernels of its own, and the
    layer still equals the unmodified layer per sample (values and gradients). FLA stands in as the token-by-token
    reference behind FLA's varlen signature, q/k heads repeated to the value heads as FLA does inside."""
    import grpo.kernels.gdn as gdn

    flags = []

    def varlen_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel, **kw):
        flags.append(use_qk_l2norm_in_kernel)
        q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
        return _varlen_sequential_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kw)

    monkeypatch.setattr(gdn, "gdn_kernels", lambda *a, **kw: (GdnKernels("fla", "fla", "test"), varlen_rule))
    _check_layer_against_per_sample(gdn_layer, kind, 4)
    assert flags and not any(flags)


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


def _windowed_conv(x, weight, conv_index):
    """out[n] = sum_i w[:, i] x[conv_index[n, i]] (index N = zero): the tree conv by its definition."""
    x_padded = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return sum(x_padded[conv_index[:, i]] * weight[:, i] for i in range(weight.shape[1]))


@pytest.mark.parametrize("seed", range(4))
def test_tree_conv_equals_its_path_windows(seed):
    """The contiguous conv plus recomputed segment starts against every token's own path window (float64, values
    and gradients), on rows of one to several levels; the rows the contiguous conv would get wrong exist, and
    leaving them out changes the result."""
    rng = random.Random(seed)
    samples = [_sample(t) for t in (multi_level(rng) if seed % 2 else shared_prompt(rng))]
    row = pack_samples(samples[:2 + seed * 2])
    index = conv_index_table(row.token_pred, 4)
    fix = conv_fix_index(index)
    assert 0 < fix.numel() < row.num_tokens
    x = torch.randn(row.num_tokens, 5, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    got = tree_causal_conv1d(x, weight, None, None, index, fix)
    want = _windowed_conv(x, weight, index)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    probe = torch.randn_like(want)
    for g, w in zip(torch.autograd.grad((got * probe).sum(), (x, weight)),
                    torch.autograd.grad((want * probe).sum(), (x, weight))):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)
    unfixed = tree_causal_conv1d(x, weight, None, None, index, fix[:0])
    assert (unfixed - want).abs()[fix].max() > 1e-3


def test_levels_bound_sequential_launches(gdn_layer):
    """One chunked call per segment-tree level, however many segments; each level padded to whole chunks."""
    row = pack_samples([_sample(t) for t in multi_level(random.Random(5))])
    depth = max(segment_levels(row.seg_parent.tolist())) + 1
    assert row.num_segments > depth
    calls = []

    def counting_rule(*args, **kwargs):
        calls.append(args[0].shape[0])
        assert args[0].shape[1] % CHUNK == 0
        return chunk_gated_delta_rule(*args, **kwargs)

    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    n, h, d = row.num_tokens, gdn_layer.num_v_heads, gdn_layer.head_k_dim
    tree_chunk_gated_delta_rule(counting_rule, torch.randn(n, h, d), torch.randn(n, h, d), torch.randn(n, h, d),
                                -torch.rand(n, h), torch.rand(n, h), plan)
    assert len(calls) == depth and sum(calls) == row.num_segments


def qwen35_model(path):
    """The tiny Qwen3.5 VLM (fp32) with weights large enough for logprobs to vary (deterministic)."""
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.model.language_model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 0.3, generator=gen).log())
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        model.lm_head.weight.mul_(10)
    return model


@pytest.fixture(scope="module")
def qwen35_pair(tiny_models):
    """(unpatched, patched) copies of the tiny Qwen3.5 VLM with weights large enough for logprobs to vary."""
    from grpo.kernels.gdn import patch_gdn_layers

    model = qwen35_model(tiny_models["qwen3_5"])
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


def unpacked_logprobs(model) -> list[float]:
    """Log-probs of the shared-prompt samples' completion tokens, one unpacked (transformers) forward per sample."""
    out = []
    with torch.no_grad():
        for s in shared_prompt(random.Random(7)):
            sample = _sample(s)
            ids = torch.tensor(sample.input_ids)[None]
            logprobs = model(input_ids=ids, use_cache=False).logits[0].float().log_softmax(-1)
            out += [float(logprobs[i - 1, t]) for i, (t, m) in enumerate(zip(sample.input_ids, sample.completion_mask))
                    if m and i > 0]
    return out


def packed_logprobs_and_grads(model_path, kernel: str) -> dict:
    """Packed forward + backward of the tiny Qwen3.5 (shared-prompt trie) with `patch_gdn_layers(model, kernel)`:
    the row's log-probs and each language-model parameter's gradient norm (JSON-able; also run in a subprocess)."""
    from grpo.kernels.gdn import patch_gdn_layers

    model = qwen35_model(model_path)
    assert patch_gdn_layers(model, kernel) == 3
    row = pack_samples([_sample(t) for t in shared_prompt(random.Random(7))])
    logprobs = _packed_logprobs(model, row)
    weights = torch.randn(logprobs.shape, generator=torch.Generator().manual_seed(2))
    named = list(model.model.language_model.named_parameters())
    grads = torch.autograd.grad((logprobs * weights).sum(), [p for _, p in named])
    return {"logprobs": logprobs.tolist(), "grad_norms": {n: float(g.norm()) for (n, _), g in zip(named, grads)}}


# ------------------------------------------------------------------ chunked kernel against the sequential reference

KERNEL_SHAPES = {  # (segments B, length T, heads H, D_k, D_v)
    "one_token": (2, 1, 2, 16, 8),
    "under_a_chunk": (2, 63, 2, 16, 8),
    "one_chunk": (1, 64, 3, 16, 16),
    "chunk_plus_one": (2, 65, 2, 32, 16),
    "several_chunks": (3, 200, 2, 16, 32),
}


def _kernel_inputs(shape, dtype=torch.float64, seed=0, initial=True):
    """q, k, v, g, beta, initial state (requires grad): log decays spread over [-2.7, -0.0025]."""
    b, t, h, d_k, d_v = shape
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, h, d_k, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(b, t, h, d_v, generator=gen, dtype=torch.float64)
    g = -torch.empty(b, t, h, dtype=torch.float64).uniform_(-6, 1, generator=gen).exp()
    beta = torch.rand(b, t, h, generator=gen, dtype=torch.float64)
    h0 = torch.randn(b, h, d_k, d_v, generator=gen, dtype=torch.float64) if initial else None
    return [None if x is None else x.to(dtype).requires_grad_() for x in (q, k, v, g, beta, h0)]


def _outputs_and_grads(rule, inputs, seed=1, **kwargs):
    """[output, final state, d q, d k, d v, d g, d beta, (d initial state)] of a random weighted loss."""
    out, final = rule(*inputs[:5], initial_state=inputs[5], output_final_state=True, use_qk_l2norm_in_kernel=True,
                      **kwargs)
    gen = torch.Generator().manual_seed(seed)
    loss = ((out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum()
            + (final.double() * torch.randn(final.shape, generator=gen, dtype=torch.float64)).sum())
    grads = torch.autograd.grad(loss, [x for x in inputs if x is not None])
    return [out, final, *grads]


_KERNEL_TERMS = ["output", "final state", "d query", "d key", "d value", "d g", "d beta", "d initial state"]


def _assert_all_close_to_scale(got, want, tol):
    for name, a, b in zip(_KERNEL_TERMS, got, want):
        _assert_close_to_scale(a.double(), b.double(), name, tol=tol)


@pytest.mark.parametrize("initial", [True, False])
@pytest.mark.parametrize("shape", list(KERNEL_SHAPES))
def test_chunked_matches_sequential(shape, initial):
    """Values, final states and gradients of every input: fp64 chunked == fp64 sequential to rounding, and the
    fp32 chunked kernel (the CPU training path) within fp32 rounding of the fp64 reference."""
    inputs64 = _kernel_inputs(KERNEL_SHAPES[shape], initial=initial)
    reference = _outputs_and_grads(sequential_gated_delta_rule, inputs64)
    _assert_all_close_to_scale(_outputs_and_grads(chunk_gated_delta_rule, inputs64), reference, tol=1e-11)
    inputs32 = [None if x is None else x.detach().float().requires_grad_() for x in inputs64]
    _assert_all_close_to_scale(_outputs_and_grads(chunk_gated_delta_rule, inputs32), reference, tol=2e-5)


def test_chunked_gradcheck():
    """Finite differences (fp64, chunk size 4 so that a 10-token call spans three chunks with a ragged end)."""
    inputs = _kernel_inputs((2, 10, 1, 4, 3))

    def rule(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)

    assert torch.autograd.gradcheck(rule, tuple(inputs))


def test_padded_batch_is_exact():
    """A batch of segments of lengths 1, 64 and 100 right-padded to 128 with zero q/k/v/g/beta (as a trie level
    is) equals each segment alone: outputs, final states and gradients (the padding leaves states unchanged)."""
    lengths, shape = [1, 64, 100], (1, 128, 2, 16, 8)
    segments = [_kernel_inputs((1, n, 2, 16, 8), seed=i) for i, n in enumerate(lengths)]
    alone = [_outputs_and_grads(sequential_gated_delta_rule, s, seed=9) for s in segments]
    batch = []
    for j in range(5):
        batch.append(torch.cat([F_pad_time(s[j].detach(), shape[1]) for s in segments]).requires_grad_())
    batch.append(torch.cat([s[5].detach() for s in segments]).requires_grad_())
    out, final = chunk_gated_delta_rule(*batch[:5], initial_state=batch[5], output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    for i, n in enumerate(lengths):
        _assert_close_to_scale(out[i, :n], alone[i][0][0], "output", tol=1e-11)
        _assert_close_to_scale(final[i], alone[i][1][0], "final state", tol=1e-11)
    # gradients: the same per-segment loss weights, summed over the batch
    gen_losses = []
    for i, n in enumerate(lengths):
        gen = torch.Generator().manual_seed(9)
        gen_losses.append((out[i:i + 1, :n] * torch.randn((1, n, 2, 8), generator=gen, dtype=torch.float64)).sum()
                          + (final[i:i + 1] * torch.randn((1, 2, 16, 8), generator=gen, dtype=torch.float64)).sum())
    grads = torch.autograd.grad(sum(gen_losses), batch)
    for i, n in enumerate(lengths):
        for j, name in enumerate(_KERNEL_TERMS[2:]):
            got = grads[j][i, :n] if j < 5 else grads[j][i]
            _assert_close_to_scale(got, alone[i][2 + j][0], name, tol=1e-11)


def F_pad_time(x, length):
    """[1, n, ...] -> [1, length, ...], zero-padded at the end."""
    return torch.cat([x, x.new_zeros((1, length - x.shape[1], *x.shape[2:]))], dim=1)


def test_unit_lower_inverse():
    """(I + A)^-1 of strictly lower A against a triangular solve, including the delta rule's worst case for a
    series expansion (64 identical unit keys, beta = 1: the Neumann terms reach binom(63, 31) ~ 1e18)."""
    gen = torch.Generator().manual_seed(0)
    for c in (1, 2, 8, 64):
        a = (torch.randn(3, c, c, generator=gen, dtype=torch.float64) * 0.5).tril(-1)
        want = torch.linalg.solve_triangular(torch.eye(c, dtype=a.dtype) + a, torch.eye(c, dtype=a.dtype).expand(3, c, c),
                                             upper=False)
        torch.testing.assert_close(unit_lower_inverse(a), want, atol=1e-12, rtol=1e-12)
    a = torch.ones(64, 64).tril(-1)
    want = torch.linalg.solve_triangular(torch.eye(64, dtype=torch.float64) + a.double(),
                                         torch.eye(64, dtype=torch.float64), upper=False)
    torch.testing.assert_close(unit_lower_inverse(a).double(), want, atol=1e-6, rtol=0)


def _recurrence_inputs(n: int, seed: int, h: int = 2, d_k: int = 16, d_v: int = 8):
    """fp64 q, k [n, h, d_k], v [n, h, d_v], log-decays g and betas [n, h] for the tree drivers, and loss weights."""
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randn(n, h, d_k, generator=gen, dtype=torch.float64),
              torch.randn(n, h, d_k, generator=gen, dtype=torch.float64),
              torch.randn(n, h, d_v, generator=gen, dtype=torch.float64),
              -torch.rand(n, h, generator=gen, dtype=torch.float64) * 0.2,
              torch.rand(n, h, generator=gen, dtype=torch.float64)]
    return inputs, torch.randn(n, h, d_v, generator=gen, dtype=torch.float64)


def test_tree_levels_chunked_equal_sequential():
    """The per-level driver with the chunked kernel == with the sequential one on a several-level trie (fp64:
    outputs and gradients, parent states carried into children)."""
    row = pack_samples([_sample(t) for t in multi_level(random.Random(5))])
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    inputs, weights = _recurrence_inputs(row.num_tokens, seed=3)
    results = []
    for rule in (chunk_gated_delta_rule, sequential_gated_delta_rule):
        xs = [x.clone().requires_grad_() for x in inputs]
        out = tree_chunk_gated_delta_rule(rule, *xs, plan)
        results.append([out, *torch.autograd.grad((out * weights).sum(), xs)])
    for name, got, want in zip(["output", "d q", "d k", "d v", "d g", "d beta"], *results):
        _assert_close_to_scale(got, want, name, tol=1e-11)


def _varlen_sequential_rule(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                            use_qk_l2norm_in_kernel):
    """FLA's varlen signature over the token-by-token reference, segment by segment ([1, n, ...] inputs)."""
    bounds = cu_seqlens_cpu.tolist()
    outs, finals = [], []
    for seg, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = None if initial_state is None else initial_state[seg:seg + 1]
        o, f = sequential_gated_delta_rule(*(t[:, lo:hi] for t in (q, k, v, g, beta)), initial_state=state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        outs.append(o)
        finals.append(f)
    return torch.cat(outs, 1), torch.cat(finals, 0)


@pytest.mark.parametrize("kind, share", [("nothing_shared", False), ("shared_prompt", False),
                                         ("shared_prompt", True), ("multi_level", True)])
def test_varlen_driver_equals_the_padded_one(kind, share):
    """The varlen driver (levels taken as row slices where their segments lie back to back, gathered otherwise; the
    output un-permuted only when the level-major order is not the row's) == the padded per-level driver, fp64
    values and gradients; unshared rows take the slice path end to end."""
    samples = [_sample(t) for t in TRIES[kind](random.Random(7))]
    row = pack_samples(samples, share_prefixes=share)
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    for level in plan.levels:  # a range exactly where the level's positions are one
        idx = level.flat_index
        is_range = bool((idx == torch.arange(int(idx[0]), int(idx[0]) + idx.numel())).all())
        assert (level.flat_range is not None) == is_range
        assert level.flat_range is None or level.flat_range == (int(idx[0]), int(idx[-1]) + 1)
    order = torch.cat([level.flat_index for level in plan.levels])
    assert plan.level_major == bool((order == torch.arange(row.num_tokens)).all())
    if not share:  # one level, the whole row
        assert plan.level_major and [lv.flat_range for lv in plan.levels] == [(0, row.num_tokens)]
    if kind == "multi_level":  # the gather path is exercised too
        assert not plan.level_major and any(lv.flat_range is None for lv in plan.levels)
    inputs, weights = _recurrence_inputs(row.num_tokens, seed=5)
    results = []
    for driver, rule in ((tree_varlen_gated_delta_rule, _varlen_sequential_rule),
                         (tree_chunk_gated_delta_rule, sequential_gated_delta_rule)):
        xs = [x.clone().requires_grad_() for x in inputs]
        out = driver(rule, *xs, plan)
        results.append([out, *torch.autograd.grad((out * weights).sum(), xs)])
    for name, got, want in zip(["output", "d q", "d k", "d v", "d g", "d beta"], *results):
        _assert_close_to_scale(got, want, name, tol=1e-12)


def test_varlen_driver_backward_scatters_only_the_initial_states():
    """The varlen driver's level-major permutations go back as gathers by the inverse permutation: in its backward
    the only `index_add_` (a scatter with atomic adds on CUDA) are the initial-state takes of the non-root levels
    (a parent's final state feeds several children), none for query, key, value, g, beta or the output."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.index_adds = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.index_adds += func.overloadpacket in (torch.ops.aten.index_add, torch.ops.aten.index_add_)
            return func(*args, **(kwargs or {}))

    row = pack_samples([_sample(t) for t in multi_level(random.Random(3))], share_prefixes=True)
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    assert not plan.level_major and len(plan.levels) >= 3
    inputs, weights = _recurrence_inputs(row.num_tokens, seed=2)
    xs = [x.clone().requires_grad_() for x in inputs]
    out = tree_varlen_gated_delta_rule(_varlen_sequential_rule, *xs, plan)
    with Count() as count:
        torch.autograd.grad((out * weights).sum(), xs)
    assert count.index_adds == len(plan.levels) - 1


@pytest.mark.parametrize("qk_norm", [None, (4, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_compiled_tree_conv_equals_the_eager_one(seed, qk_norm, monkeypatch):
    """`tree_conv_formula` under torch.compile (aot_eager: dynamo + AOTAutograd tracing, dynamic shapes; inductor's
    codegen is checked on the GPU by bench_step --check) == the eager tree conv with bias and SiLU, fp64 values and
    gradients, reached through `tree_causal_conv1d` once compiled; rows of several lengths and fix-row counts
    (one with none) go through the same compiled function. With `qk_norm` (channels, head_dim) the leading channels
    come out L2-normalised per head, as transformers' `l2norm` would make them."""
    import grpo.kernels.gdn as gdn

    compiled_formula = torch.compile(gdn.tree_conv_formula, backend="aot_eager", dynamic=True)
    calls = []

    def counted(*args):
        calls.append(args[3].shape[0])
        return compiled_formula(*args)

    rng = random.Random(seed)
    rows = [pack_samples([_sample(t) for t in multi_level(rng)][:3 + seed]),
            pack_samples([_sample(t) for t in shared_prompt(rng)]),
            pack_samples([_sample(_tokens(rng, 9 + seed))])]
    for row in rows:
        index = conv_index_table(row.token_pred, 4)
        fix = conv_fix_index(index)
        x = torch.randn(row.num_tokens, 6, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
        bias = torch.randn(6, dtype=torch.float64, requires_grad=True)
        probe = torch.randn(row.num_tokens, 6, dtype=torch.float64)
        results = []
        for compiled in ({"conv": counted}, {}):
            monkeypatch.setattr(gdn, "_COMPILED", compiled)
            out = tree_causal_conv1d(x, weight, bias, "silu", index, fix, qk_norm)
            results.append([out, *torch.autograd.grad((out * probe).sum(), (x, weight, bias))])
        assert calls[-1] == fix.numel()
        for name, got, want in zip(["output", "d x", "d weight", "d bias"], *results):
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0, msg=name)
        want = torch.nn.functional.silu(_windowed_conv(x, weight, index) + bias)  # and the definition itself
        if qk_norm is not None:
            from transformers.models.qwen3_5.modeling_qwen3_5 import l2norm

            channels, head_dim = qk_norm
            heads = want[:, :channels].reshape(-1, channels // head_dim, head_dim)
            want = torch.cat([l2norm(heads, dim=-1, eps=1e-6).reshape(-1, channels), want[:, channels:]], dim=1)
        torch.testing.assert_close(results[0][0], want, atol=1e-12, rtol=0)
    assert len(calls) == len(rows) and 0 in calls and max(calls) > 0


def test_compiled_gates_equal_the_eager_ones():
    """`gdn_gates` under torch.compile (aot_eager, dynamic shapes: two row lengths, one compiled function) == eager
    == transformers' own g and beta formula, fp64 values and gradients of a, b, A_log and dt_bias."""
    import grpo.kernels.gdn as gdn

    compiled = torch.compile(gdn.gdn_gates, backend="aot_eager", dynamic=True)
    gen = torch.Generator().manual_seed(0)
    a_log = torch.rand(4, generator=gen, dtype=torch.float64).requires_grad_()
    dt_bias = torch.randn(4, generator=gen, dtype=torch.float64).requires_grad_()
    for n in (7, 19):
        a, b = (torch.randn(n, 4, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(2))
        probe_g, probe_beta = torch.randn(n, 4, dtype=torch.float64), torch.randn(n, 4, dtype=torch.float64)
        results = []
        for fn in (compiled, gdn.gdn_gates,
                   lambda a, b, a_log, dt: (-a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt),
                                            b.sigmoid())):
            g, beta = fn(a, b, a_log, dt_bias)
            loss = (g * probe_g).sum() + (beta * probe_beta).sum()
            results.append([g, beta, *torch.autograd.grad(loss, (a, b, a_log, dt_bias))])
        for got in results[:2]:
            for name, x, want in zip(["g", "beta", "d a", "d b", "d A_log", "d dt_bias"], got, results[2]):
                torch.testing.assert_close(x, want, atol=1e-12, rtol=0, msg=name)


def test_chunked_bf16_inputs():
    """bf16 inputs (the GPU training path): bf16 matmul operands, fp32 decays / inverse / state. Against the fp64
    reference on the same bf16-rounded inputs the error stays at bf16 level; with fp32 operands it is fp32-small,
    so the only loss is the operands' rounding."""
    inputs = _kernel_inputs((2, 150, 2, 32, 32), dtype=torch.bfloat16)
    inputs[3] = inputs[3].detach().float().requires_grad_()  # g arrives in fp32 (computed from A_log.float())
    inputs[5] = inputs[5].detach().float().requires_grad_()  # parent final states are fp32
    reference = _outputs_and_grads(sequential_gated_delta_rule,
                                   [x.detach().double().requires_grad_() for x in inputs])
    _assert_all_close_to_scale(_outputs_and_grads(chunk_gated_delta_rule, inputs), reference, tol=3e-2)
    _assert_all_close_to_scale(_outputs_and_grads(chunk_gated_delta_rule, inputs, matmul_dtype=torch.float32),
                               reference, tol=1e-2)


# ------------------------------------------------------------------------------------------------ kernel choice

@pytest.mark.parametrize("triton_version, capability, expected", [
    ("3.6.0", (9, 0), (True, False)),  # H100/H200 with torch 2.11's Triton: FLA's gated backward is wrong
    ("3.4.0", (9, 0), (True, False)),
    ("3.7.0", (9, 0), (True, False)),
    ("3.7.1", (9, 0), (True, True)),
    ("3.8.0", (9, 0), (True, True)),
    ("3.3.1", (9, 0), (True, True)),
    ("3.6.0", (8, 0), (True, True)),  # A100
    ("3.6.0", (10, 0), (True, True)),  # Blackwell
    ("3.6.0", (12, 0), (True, True)),
    (None, (9, 0), (False, False)),  # no Triton
    ("3.6.0", None, (False, False)),  # no CUDA device
])
def test_fla_directions(triton_version, capability, expected):
    forward_ok, backward_ok, reason = fla_directions(triton_version, capability)
    assert (forward_ok, backward_ok) == expected and reason


@pytest.mark.parametrize("choice, triton_version, capability, expected", [
    ("auto", "3.6.0", (9, 0), ("fla", "fla", True)),  # FLA's backward with its refused step in torch
    ("fla", "3.6.0", (9, 0), ("fla", "fla", True)),
    ("auto", "3.7.1", (9, 0), ("fla", "fla", False)),  # FLA's own step where it is correct
    ("auto", "3.6.0", (8, 0), ("fla", "fla", False)),
    ("torch", "3.6.0", (9, 0), ("torch", "torch", False)),
    ("auto", None, (9, 0), ("torch", "torch", False)),
])
def test_kernel_rule_with_a_replaceable_dqkwg(choice, triton_version, capability, expected):
    kernels = choose_gdn_kernels(choice, "cuda", True, triton_version, capability, dqkwg_replaceable=True)
    assert (kernels.forward, kernels.backward, kernels.torch_dqkwg) == expected
    if kernels.torch_dqkwg:
        assert "chunk_bwd_dqkwg step in torch" in kernels.describe()



@pytest.mark.parametrize("choice, device, fla, triton_version, capability, expected", [
    ("torch", "cuda", True, "3.8.0", (9, 0), ("torch", "torch")),  # torch is torch whatever is installed
    ("torch", "cpu", True, None, None, ("torch", "torch")),
    ("auto", "cpu", True, None, None, ("torch", "torch")),
    ("auto", "cuda", False, "3.6.0", (9, 0), ("torch", "torch")),
    ("auto", "cuda", True, "3.6.0", (9, 0), ("fla", "torch")),  # FLA only where it is correct: forward
    ("auto", "cuda", True, "3.7.1", (9, 0), ("fla", "fla")),
    ("auto", "cuda", True, "3.6.0", (8, 0), ("fla", "fla")),
    ("auto", "cuda", True, None, (9, 0), ("torch", "torch")),
    ("fla", "cuda", True, "3.6.0", (9, 0), ("fla", "torch")),  # forced, still never the wrong backward
    ("fla", "cuda", True, "3.8.0", (9, 0), ("fla", "fla")),
    ("fla", "cpu", True, None, None, ValueError),
    ("fla", "cuda", False, "3.8.0", (9, 0), ImportError),
    ("fla", "cuda", True, None, (9, 0), RuntimeError),
    ("fast", "cuda", True, "3.8.0", (9, 0), ValueError),
])
def test_kernel_rule(choice, device, fla, triton_version, capability, expected):
    if isinstance(expected, type):
        with pytest.raises(expected):
            choose_gdn_kernels(choice, device, fla, triton_version, capability)
        return
    kernels = choose_gdn_kernels(choice, device, fla, triton_version, capability)
    assert (kernels.forward, kernels.backward) == expected
    assert kernels.for_forward(needs_grad=False) == expected[0]
    assert kernels.for_forward(needs_grad=True) == expected[1]  # a backward differentiates its own forward


def test_kernel_choice_logged_once(gdn_layer, monkeypatch, caplog):
    """One INFO line at first use names the forward and the backward kernel; fla on CPU is refused by name."""
    import logging

    import grpo.kernels.gdn_choice as gdn_choice

    monkeypatch.setattr(gdn_choice, "_KERNEL_CHOICE", {})
    row = pack_samples([_sample(t) for t in shared_prompt(random.Random(0))])
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, gdn_layer.conv_kernel_size)
    hidden = torch.randn(1, row.num_tokens, gdn_layer.hidden_size, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="grpo.kernels.gdn"):
        for _ in range(2):
            tree_gdn_forward(gdn_layer, hidden, plan).sum().backward()
    lines = [r.getMessage() for r in caplog.records if "Gated DeltaNet recurrence" in r.getMessage()]
    assert len(lines) == 1 and "forward torch chunked; backward torch chunked" in lines[0], lines
    assert GdnKernels("fla", "torch", "x").describe().startswith(
        "forward fla varlen (no-grad forwards), torch chunked (forwards that need gradients); backward torch")
    monkeypatch.setattr(gdn_layer, "_tree_gdn_kernel", "fla", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        tree_gdn_forward(gdn_layer, hidden, plan)


_STUB_SCRIPT = r"""
import json, logging, sys
repo, tests, stub, model_path = sys.argv[1:5]
sys.path[:0] = [stub, repo, tests]
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
import fla
from fla.ops.gated_delta_rule import StubFLACalled
assert fla.__file__.startswith(stub), fla.__file__
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5
x = torch.zeros(1, 4, 1, 8)
try:
    modeling_qwen3_5.torch_chunk_gated_delta_rule(x, x, x, g=x[..., 0], beta=x[..., 0])
except StubFLACalled:
    pass
else:
    raise AssertionError("transformers did not bind its GDN kernel to the importable fla: the test proves nothing")
import test_gdn
from grpo.kernels.gdn import transformers_torch_reference
model = test_gdn.qwen35_model(model_path)
try:
    test_gdn.unpacked_logprobs(model)
except StubFLACalled:
    pass
else:
    raise AssertionError("the unpacked forward did not reach the importable fla: the reference check proves nothing")
with transformers_torch_reference(model):
    reference = test_gdn.unpacked_logprobs(model)
result = {k: test_gdn.packed_logprobs_and_grads(model_path, k) for k in ("torch", "auto")}
print("RESULT " + json.dumps({**result, "reference": reference}))
"""


def test_torch_path_never_reaches_importable_fla(tiny_models):
    """With a stub `fla` importable (kernels raise; transformers binds its Qwen3.5 GDN kernels to it), the
    tiny Qwen3.5's packed forward + backward with gdn_kernel=torch and =auto (CPU) runs and equals this process's
    run without the stub. A subprocess, so the stub never enters this interpreter's sys.modules."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", _STUB_SCRIPT, str(tests.parent), str(tests), str(tests / "fla_stub"),
                           str(tiny_models["qwen3_5"])], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "forward torch chunked; backward torch chunked" in proc.stderr, proc.stderr[-4000:]
    assert "fla" not in sys.modules  # nothing leaked here
    stubbed = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))[len("RESULT "):])
    # transformers_torch_reference: the unpacked forward runs transformers' torch path although fla imports
    torch.testing.assert_close(torch.tensor(stubbed.pop("reference")),
                               torch.tensor(unpacked_logprobs(qwen35_model(tiny_models["qwen3_5"]))),
                               atol=1e-6, rtol=1e-6)
    here = packed_logprobs_and_grads(tiny_models["qwen3_5"], "torch")
    for kernel, result in stubbed.items():
        torch.testing.assert_close(torch.tensor(result["logprobs"]), torch.tensor(here["logprobs"]),
                                   atol=1e-6, rtol=1e-6, msg=f"gdn_kernel={kernel}")
        assert result["grad_norms"].keys() == here["grad_norms"].keys()
        torch.testing.assert_close(torch.tensor(list(result["grad_norms"].values())),
                                   torch.tensor(list(here["grad_norms"].values())), atol=1e-6, rtol=1e-5)


def fake_fla_on_hopper(monkeypatch, triton_version: str, with_chunk: bool, guard: bool):
    """An importable stub fla (its varlen rule; with `with_chunk` its chunk module's dqkwg step, with `guard` the
    Triton-version flag FLA's guard reads), the given Triton version and a Hopper device capability: the facts
    `gdn_kernels` reads. Returns (rule module, chunk module, chunk_o module, FLA's own dqkwg step)."""
    import sys
    import types

    import triton

    fake = types.ModuleType("fla.ops.gated_delta_rule")
    fake.chunk_gated_delta_rule = lambda *a, **k: None
    modules = [("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
               ("fla.ops.gated_delta_rule", fake)]
    chunk = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    chunk.chunk_bwd_dqkwg = flas_own = lambda *a, **k: chunk_o.TRITON_ABOVE_3_7_1  # what the guard would read
    chunk_o = types.ModuleType("fla.ops.common.chunk_o")
    chunk_o.TRITON_ABOVE_3_7_1 = False
    if with_chunk:
        fake.chunk = chunk
        modules.append(("fla.ops.gated_delta_rule.chunk", chunk))
    if guard:
        modules += [("fla.ops.common", types.ModuleType("fla.ops.common")), ("fla.ops.common.chunk_o", chunk_o)]
    else:
        monkeypatch.setitem(sys.modules, "fla.ops.common.chunk_o", None)  # not importable
    for name, module in modules:
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(triton, "__version__", triton_version)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    return fake, chunk, chunk_o, flas_own


@pytest.mark.parametrize("triton_version, with_chunk, guard, fails, expected, checked", [
    ("3.6.0", False, False, (), ("fla", "torch", ""), []),  # no replaceable step: FLA forward only, unchecked
    ("3.7.1", False, False, (), ("fla", "fla", ""), ["own"]),  # FLA's own backward, checked first
    ("3.6.0", True, False, (), ("fla", "fla", "torch"), ["torch"]),  # FLA's backward with its dqkwg step in torch
    ("3.6.0", True, False, ("torch",), ("fla", "torch", ""), ["torch"]),  # ... which fails its check: torch
    ("3.6.0", True, True, (), ("fla", "fla", "unguarded"), ["unguarded"]),  # FLA's own step past its guard
    ("3.6.0", True, True, ("unguarded",), ("fla", "fla", "torch"), ["unguarded", "torch"]),  # ... fails: torch step
    ("3.6.0", True, True, ("unguarded", "torch"), ("fla", "torch", ""), ["unguarded", "torch"]),  # both fail
])
def test_gdn_kernels_reads_this_machine(monkeypatch, caplog, triton_version, with_chunk, guard, fails, expected,
                                        checked):
    """`gdn_kernels` feeds the rule the installed Triton's version and the device's capability (faked here: a
    Hopper GPU, an importable fla), and where FLA refuses its dqkwg step tries FLA's own past its guard (when the
    guard's flag exists), then the torch step, each checked at the model's head sizes against the torch kernel
    before use; it puts FLA's own back when both fail, and logs the choice once."""
    import logging

    import grpo.kernels.gdn as gdn
    from grpo.kernels.gdn_dqkwg import chunk_bwd_dqkwg

    fake, chunk, chunk_o, flas_own = fake_fla_on_hopper(monkeypatch, triton_version, with_chunk, guard)
    import grpo.kernels.gdn_choice as gdn_choice

    monkeypatch.setattr(gdn_choice, "_KERNEL_CHOICE", {})
    checks = []

    def step_name(step) -> str:
        return {id(flas_own): "own", id(chunk_bwd_dqkwg): "torch"}.get(id(step), "unguarded")

    def check(rule, device, heads):
        assert heads == (4, 8, 128, 32)  # the layer's heads and head sizes reach the check
        checks.append(step_name(chunk.chunk_bwd_dqkwg))
        if checks[-1] == "unguarded":
            assert chunk.chunk_bwd_dqkwg() is True and chunk_o.TRITON_ABOVE_3_7_1 is False  # lifted for the call only
        if checks[-1] in fails:
            raise RuntimeError("dk is off by 0.5 of its scale")

    monkeypatch.setattr(gdn_choice, "_check_backward", check)
    monkeypatch.setattr(gdn_choice, "_forward_probe_passes", lambda rule, device: True)
    with caplog.at_level(logging.INFO, logger="grpo.kernels.gdn"):
        kernels, rule = gdn.gdn_kernels("auto", torch.device("cuda", 0), (4, 8, 128, 32))
        assert gdn.gdn_kernels("auto", torch.device("cuda", 0), (4, 8, 128, 32)) == (kernels, rule)
    step = "torch" if kernels.torch_dqkwg else "unguarded" if kernels.unguarded_dqkwg else ""
    assert (kernels.forward, kernels.backward, step) == expected
    assert rule is fake.chunk_gated_delta_rule
    assert checks == checked
    assert step_name(chunk.chunk_bwd_dqkwg) == (step or "own")  # a step that failed is never left in
    lines = [r.getMessage() for r in caplog.records if "Gated DeltaNet recurrence" in r.getMessage()]
    assert len(lines) == 1 and f"backward {'fla varlen' if expected[1] == 'fla' else 'torch chunked'}" in lines[0]
    assert ("failed its check" in lines[0]) == bool(fails)
    assert ("past its Triton guard" in lines[0]) == (step == "unguarded")
    if with_chunk:  # whatever step is in, FLA's own is what a later choice (other head sizes) starts from
        assert gdn_choice.install_torch_dqkwg() is flas_own


def test_a_long_fla_check_logs_progress(monkeypatch, caplog):
    """FLA's first use autotunes for minutes inside `gdn_kernels`' check: a "still waiting" line comes every
    CHECK_PROGRESS_S while it runs (here a stub check that sleeps), none once the choice is made."""
    import logging
    import time

    import grpo.kernels.gdn_choice as gdn_choice

    fake_fla_on_hopper(monkeypatch, "3.7.1", False, False)
    monkeypatch.setattr(gdn_choice, "_KERNEL_CHOICE", {})
    monkeypatch.setattr(gdn_choice, "CHECK_PROGRESS_S", 0.2)
    monkeypatch.setattr(gdn_choice, "_check_backward", lambda rule, device, heads: time.sleep(1.1))

    def waiting() -> list[str]:
        return [r.getMessage() for r in caplog.records if "still waiting for FLA's Gated DeltaNet check on cuda:0"
                in r.getMessage()]

    with caplog.at_level(logging.INFO):
        kernels, _ = gdn_choice.gdn_kernels("auto", torch.device("cuda", 0), (4, 8, 128, 32))
        lines = waiting()
        time.sleep(0.5)
    assert (kernels.forward, kernels.backward) == ("fla", "fla")
    assert 3 <= len(lines) <= 6, lines
    assert waiting() == lines  # nothing after the check returned


def test_compile_layer_regions_compiles_the_gdn_kernel_regions(tiny_models, monkeypatch):
    """compile_layer_regions on a GDN model compiles its gated norms and routes the tree conv through the compiled
    formula; with GRPO_GDN_COMPILE=1 it also swaps in torch.compile'd state-free regions of
    the torch kernel (their values and gradients against the eager kernel: scripts/bench_gdn.py --compile on a GPU;
    compiling them here takes minutes of CPU), and only on a GDN model; without it they stay eager."""
    import sys

    import grpo.kernels.gdn_kernel as gdn
    from grpo.model import compile_layer_regions, load_policy

    import grpo.kernels.gdn as tree_gdn

    eager = gdn._chunk_prepare, gdn._chunk_output
    models = {kind: load_policy(str(tiny_models[kind]), "float32") for kind in ("qwen3", "qwen3_5")}
    modeling = {sys.modules[type(m).__module__] for model in models.values() for m in model.modules()
                if hasattr(sys.modules[type(m).__module__], "apply_rotary_pos_emb")}
    ropes = {module: module.apply_rotary_pos_emb for module in modeling}  # compile_layer_regions swaps these too
    try:
        monkeypatch.setattr(tree_gdn, "_COMPILED", {})
        monkeypatch.delenv("GRPO_GDN_COMPILE", raising=False)
        compile_layer_regions(models["qwen3"])
        assert not tree_gdn._COMPILED  # no GDN layer: the tree conv and gates stay eager
        compile_layer_regions(models["qwen3_5"])
        assert (gdn._chunk_prepare, gdn._chunk_output) == eager
        assert set(tree_gdn._COMPILED) == {"conv", "gates"}  # compiled whenever the layers are
        gated = [m for m in models["qwen3_5"].modules() if type(m).__name__.endswith("RMSNormGated")]
        assert gated and all(m._compiled_call_impl is not None for m in gated)
        monkeypatch.setenv("GRPO_GDN_COMPILE", "1")
        compile_layer_regions(models["qwen3"])
        assert (gdn._chunk_prepare, gdn._chunk_output) == eager
        compile_layer_regions(models["qwen3_5"])
        assert gdn._chunk_prepare._grpo_compiled and gdn._chunk_output._grpo_compiled
    finally:
        gdn._chunk_prepare, gdn._chunk_output = eager
        for module, rope in ropes.items():
            module.apply_rotary_pos_emb = rope
