"""The fast GPU step (`build_policy`: FSDP2 bf16 mixed precision on one GPU, compiled norms/MLP/rotary, bf16 LM
head) computes the same log-probs as per-sample forwards of an eager bf16 model, for dense and Gated DeltaNet
layers; and one real optimizer step runs with every piece on. Skipped without CUDA (`pytest -m gpu`)."""

from __future__ import annotations

import contextlib
import math
import traceback
import warnings
from pathlib import Path

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
def test_fast_path_packed_matches_per_sample(tiny_models, kind):
    from bench_check import check_packed_vs_unpacked

    from grpo.distributed import init_distributed

    result = check_packed_vs_unpacked(tiny_models[kind], init_distributed(), {})
    assert result["terms"] == 4 * 60
    # bf16 tolerance, measured: no worse than an eager bf16 per-sample forward against the same fp32 reference
    assert result["mean_abs_diff"] <= 1.5 * result["eager_bf16_mean_abs_diff"] + 1e-3, result
    assert result["max_abs_diff"] <= 2.0 * result["eager_bf16_max_abs_diff"] + 1e-2, result


@pytest.mark.gpu
def test_fast_step_trains(tiny_models):
    """Two steps on one batch through the real step: the loss moves and every piece reported itself on."""
    import dataclasses

    from bench_groups import synthetic_groups

    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import decoder_layers, init_distributed
    from grpo.losses import loss_function
    from grpo.policy import build_policy
    from grpo.step import optimizer_step, train_micro_batch
    from grpo.step_metrics import resolve_metrics
    from grpo.step_plan import StepPlan

    info = init_distributed()
    config = dataclasses.replace(AsyncGRPOConfig(model=str(tiny_models["qwen3"]), token_budget=4096),
                                 gradient_checkpointing="true", learning_rate=1e-3)
    model, policy, optimizer, scheduler, autocast = build_policy(config, info, 4096)
    assert all(layer.gradient_checkpointing for layer in decoder_layers(model))
    samples = [s for s, _ in zip(synthetic_groups(1000, True, config.num_sampler_logprobs, group_size=4,
                                                  prompt_len=100, completion_len=40), range(4))]
    plan = StepPlan([samples], sum(s.num_trained for s in samples))
    losses = []
    for _ in range(2):
        m = resolve_metrics([train_micro_batch(policy, samples, plan, loss_function(config.loss), config.loss, 1, 1,
                                               autocast, config.max_completion_length)])[0]
        grad_norm, _, _ = optimizer_step(policy, optimizer, scheduler, config.max_grad_norm)
        assert math.isfinite(grad_norm)  # read from the step's pinned copy: a float
        losses.append(m["loss"])
    assert losses[0] != losses[1]


@pytest.mark.gpu
def test_a_step_waits_for_the_gpu_only_at_its_end(tiny_models):
    """The default step (compiled layers, flash_split, master weights, fused AdamW) queues forward, loss, backward
    and optimizer without the host waiting for the GPU: under CUDA's sync debug mode it makes no synchronising call
    at all (its metrics, gradient norm and non-finite verdict are copied to pinned memory as they are queued and
    read after the step's own timer event, whose wait the mode does not count). A `.item()` first shows the mode
    records a sync. Steps 1-2 warm up (compilation)."""
    from bench_groups import synthetic_groups

    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import init_distributed
    from grpo.losses import loss_function
    from grpo.policy import build_policy
    from grpo.step import optimizer_step, train_micro_batch
    from grpo.step_plan import StepPlan

    info = init_distributed()
    config = AsyncGRPOConfig(model=str(tiny_models["qwen3"]), token_budget=4096)
    _, policy, optimizer, scheduler, autocast = build_policy(config, info, 4096)
    samples = [s for s, _ in zip(synthetic_groups(1000, True, config.num_sampler_logprobs, group_size=4,
                                                  prompt_len=100, completion_len=40), range(8))]
    plan = StepPlan([samples], sum(s.num_trained for s in samples))

    def step():
        m = train_micro_batch(policy, samples, plan, loss_function(config.loss), config.loss, 1, 1, autocast,
                              config.max_completion_length)
        return optimizer_step(policy, optimizer, scheduler, config.max_grad_norm, [m["loss"]])

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with sync_stacks() as stacks:
        torch.zeros(1, device="cuda").item()  # the control: a sync the mode must record
        control = len(stacks)
        assert step()[2]
    assert control, "sync debug mode recorded no sync for an .item(): the step cannot be checked with it"
    inside = stacks[control:]
    assert not inside, "the host waited for the GPU inside the step:\n" + "\n".join(
        " <- ".join(f"{name}:{line}" for name, line in reversed(s[-10:])) for s in inside)


@contextlib.contextmanager
def sync_stacks():
    """Record the Python stack [(file name, line), ...] of every CUDA synchronisation under sync debug mode "warn"
    (the warning is shown while the synchronising call is still on the stack). Only c10's sync warning counts:
    another warning mentioning synchronisation, raised on torch 2.11 while the mode is switched on, is not a sync."""
    stacks: list[list[tuple[str, int]]] = []

    def show(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):
            stacks.append([(Path(f.filename).name, f.lineno) for f in traceback.extract_stack()[:-1]])

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield stacks
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _gdn_level_inputs(seed=0, h_k=2, h_v=4, d=128):
    """A several-level trie on CUDA, its scan plan, and q/k/v/g/beta [N, H, ...] in fp32 with loss weights."""
    import random

    from test_gdn import _sample, multi_level

    from grpo.kernels.gdn import plan_tree_scan
    from grpo.trie import pack_samples

    row = pack_samples([_sample(t) for t in multi_level(random.Random(7))]).to("cuda")
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    n = row.input_ids.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    inputs = [torch.randn(n, h_k, d, device="cuda", generator=gen),
              torch.randn(n, h_k, d, device="cuda", generator=gen),
              torch.randn(n, h_v, d, device="cuda", generator=gen),
              -torch.rand(n, h_v, device="cuda", generator=gen) * 0.3, torch.rand(n, h_v, device="cuda", generator=gen)]
    return plan, inputs, torch.randn(n, h_v, d, device="cuda", generator=gen)


def _torch_levels(rule, q, k, v, g, beta, plan):
    from grpo.kernels.gdn import tree_chunk_gated_delta_rule

    rep = v.shape[1] // q.shape[1]
    return tree_chunk_gated_delta_rule(rule, q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1), v, g, beta, plan)


def _scale_error(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6))


@pytest.mark.gpu
def test_chunked_torch_kernel_on_gpu_matches_fp32_reference():
    """grpo.kernels.gdn's chunked kernel on CUDA per trie level against the token-by-token fp32 reference: fp32 inputs to
    fp32 rounding, bf16 inputs (the training path: bf16 matmul operands) to bf16 level; outputs and the gradients
    of q, k, v, g, beta."""
    from grpo.kernels.gdn import chunk_gated_delta_rule, sequential_gated_delta_rule

    plan, inputs, weights = _gdn_level_inputs()
    results = {}
    for name, rule, dtype in [("reference", sequential_gated_delta_rule, torch.float32),
                              ("fp32", chunk_gated_delta_rule, torch.float32),
                              ("bf16", chunk_gated_delta_rule, torch.bfloat16)]:
        xs = [t.clone().to(dtype if i != 3 else torch.float32).requires_grad_() for i, t in enumerate(inputs)]
        out = _torch_levels(rule, *xs, plan)
        (out.float() * weights).sum().backward()
        results[name] = [out.float()] + [t.grad.float() for t in xs]
    for name, tol in [("fp32", 1e-4), ("bf16", 3e-2)]:
        for term, got, want in zip(["out", "dq", "dk", "dv", "dg", "dbeta"], results[name], results["reference"]):
            assert _scale_error(got, want) < tol, f"{name} {term}: {_scale_error(got, want):.3g}"


@pytest.mark.gpu
def test_fla_varlen_recurrence_matches_padded_torch_levels():
    """The varlen FLA kernel per trie level, and FLA's kernels in one pass over the row (grpo/kernels/gdn_fla.py, where this
    fla-core has the internals it launches) == grpo.kernels.gdn's chunked torch kernel on padded levels: outputs and the
    gradients of q, k, v, g, beta (bf16 inputs; tolerance relative to the values' scale). Where `fla_directions`
    refuses FLA's backward on this Triton/GPU, FLA's backward runs with its `chunk_bwd_dqkwg` step in torch
    (grpo/kernels/gdn_dqkwg.py); only if that step cannot be replaced is the forward alone compared."""
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    import triton

    from grpo.kernels.gdn import chunk_gated_delta_rule, fla_directions, tree_varlen_gated_delta_rule
    from grpo.kernels.gdn_choice import install_torch_dqkwg
    from grpo.kernels.gdn_fla import fla_tree_kernels, tree_fla_gated_delta_rule
    from grpo.kernels.gdn_kernel import l2norm

    _, backward_ok, reason = fla_directions(triton.__version__, torch.cuda.get_device_capability())
    if not backward_ok and install_torch_dqkwg():
        backward_ok, reason = True, f"{reason}; FLA's chunk_bwd_dqkwg step replaced by grpo/kernels/gdn_dqkwg.py"
    print(f"FLA backward compared: {backward_ok} ({reason})")
    plan, inputs, weights = _gdn_level_inputs(d=64)
    one_pass = fla_tree_kernels() is not None
    results = {}
    for path in ("fla per level", "fla one pass", "torch"):
        if path == "fla one pass" and not one_pass:
            continue
        q, k, v, g, beta = [t.clone().to(torch.bfloat16 if i in (0, 1, 2, 4) else torch.float32).requires_grad_()
                            for i, t in enumerate(inputs)]
        if path == "fla per level":
            out = tree_varlen_gated_delta_rule(fla.chunk_gated_delta_rule, q, k, v, g, beta, plan)
        elif path == "fla one pass":  # takes q and k normalised, as the tree conv hands them over
            qn, kn = (l2norm(x.float()).to(x.dtype) for x in (q, k))
            out = tree_fla_gated_delta_rule(qn, kn, v, g, beta, plan)
        else:
            out = _torch_levels(chunk_gated_delta_rule, q, k, v, g, beta, plan)
        if backward_ok:
            (out.float() * weights).sum().backward()
            results[path] = [out.float()] + [t.grad.float() for t in (q, k, v, g, beta)]
        else:
            results[path] = [out.float()]
    print(f"FLA's one-pass tree rule compared: {one_pass}")
    for path in results.keys() - {"torch"}:
        for name, got, want in zip(["out", "dq", "dk", "dv", "dg", "dbeta"], results[path], results["torch"]):
            error = _scale_error(got, want)
            assert error < 3e-2, f"{path} {name}: max error {error:.3g} of the values' scale"
    if not backward_ok:
        pytest.skip(f"forward matches; FLA's backward not compared: {reason}")


@pytest.mark.gpu
def test_gdn_kernel_choice_on_this_gpu(tiny_models, caplog):
    """gdn_kernel=auto on this GPU follows the rule (probe included), and a packed Qwen3.5 forward + backward
    runs on whatever it picked (the Hopper + Triton < 3.7.1 crash in FLA's backward was this path)."""
    import logging
    import random

    from test_gdn import _sample, shared_prompt

    from grpo.kernels import gdn
    from grpo.tree_attention import forward_hidden
    from grpo.trie import pack_samples

    caplog.set_level(logging.INFO, logger="grpo.kernels.gdn")
    import grpo.kernels.gdn_choice as gdn_choice

    gdn_choice._KERNEL_CHOICE.clear()
    kernels, fla_rule = gdn.gdn_kernels("auto", torch.device("cuda"))
    assert any("Gated DeltaNet recurrence" in r.getMessage() for r in caplog.records)
    try:
        import triton

        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
        forward_ok, backward_ok, _ = gdn.fla_directions(triton.__version__, torch.cuda.get_device_capability())
        assert kernels.backward == "torch" or backward_ok or kernels.torch_dqkwg or kernels.unguarded_dqkwg
        assert (kernels.forward == "fla") == (fla_rule is not None)
        from grpo.kernels.gdn_fla import fla_tree_kernels

        assert kernels.one_pass == (kernels.forward == "fla" and fla_tree_kernels() is not None), kernels.describe()
    except ImportError:
        assert (kernels.forward, kernels.backward) == ("torch", "torch")
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_models["qwen3_5"], dtype=torch.bfloat16).cuda()
    gdn.patch_gdn_layers(model, "auto")
    row = pack_samples([_sample(t) for t in shared_prompt(random.Random(0))])
    hidden = forward_hidden(model, row, backend="sdpa")
    hidden.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.model.language_model.parameters() if p.grad is not None)
    with torch.no_grad():  # no-grad forwards may use FLA's forward
        torch.testing.assert_close(forward_hidden(model, row, backend="sdpa").float(), hidden.detach().float(),
                                   atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_compiled_gdn_mixer_matches_the_eager_layer(tiny_models):
    """compile_scope=layers_gdn: a Qwen3.5 GDN layer's mixer as one inductor graph with FLA's one-pass rule as a custom
    op inside (grpo/kernels/gdn_graph.py) == the eager tree forward with the same rule, bf16, on a several-level row out of
    level-major order and an unshared one: output and the input's and weights' gradients within 3e-2 of scale."""
    pytest.importorskip("fla.ops.gated_delta_rule")
    import random

    from test_gdn import _sample, multi_level, nothing_shared
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from grpo.kernels import gdn, gdn_graph
    from grpo.trie import pack_samples

    config = AutoConfig.from_pretrained(tiny_models["qwen3_5"]).text_config
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).to("cuda", torch.bfloat16)
    heads = (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    for make in (multi_level, nothing_shared):
        row = pack_samples([_sample(t) for t in make(random.Random(3))]).to("cuda")
        plan = gdn.plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, layer.conv_kernel_size)
        hidden = torch.randn(1, row.num_tokens, layer.hidden_size, device="cuda", dtype=torch.bfloat16)
        results = []
        for compiled in (False, True):
            if compiled:
                gdn_graph.compile_gdn_mixer()
            x = hidden.clone().requires_grad_()
            layer.zero_grad()
            try:
                out = gdn.tree_gdn_forward(layer, x, plan)
            finally:
                gdn_graph._COMPILED.pop("mixer", None)
            kernels, _ = gdn.gdn_kernels("auto", x.device, heads)
            if not kernels.one_pass:
                pytest.skip(f"FLA does not run in one pass here: {kernels.describe()}")
            (out.float() * torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)).sum().backward()
            results.append([out.float(), x.grad.float()] + [p.grad.float() for p in layer.parameters()])
        for i, (got, want) in enumerate(zip(*results)):
            assert _scale_error(got, want) < 3e-2, f"{make.__name__} term {i}: {_scale_error(got, want):.3g}"
