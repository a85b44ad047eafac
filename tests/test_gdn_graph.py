"""grpo/kernels/gdn_graph.py: a Gated DeltaNet mixer as one compiled graph, the recurrence a custom op inside.

On CPU the op runs the token-by-token recurrence (FLA's kernels need CUDA), so these tests check the op's contract
(fake and autograd registrations), the mixer formula against the layer's own tree forward, and the formula under
torch.compile (aot_eager: dynamo + AOTAutograd with the op opaque, dynamic shapes) across rows of other shapes
without recompiling. The CUDA side (FLA's one-pass rule inside the op) is tests/test_gpu_step.py's.
"""

from __future__ import annotations

import random

import pytest
import torch

from grpo.kernels.gdn import plan_tree_scan, tree_gdn_forward
from grpo.kernels.gdn_graph import gdn_tree_rule_op, mixer_formula, mixer_tables, mixer_weights
from grpo.trie import pack_samples
from test_gdn import TRIES, _sample

ROWS = ["shared_prompt", "multi_level", "nothing_shared", "one_sequence"]
GATE_ROUNDING = 1e-6
"""Tolerance of the layer comparisons (fp64 weights and inputs): the gates are computed in fp32 as transformers does
(`gdn_gates`), and the mixer takes them in level-major order where the layer's forward permutes them after, so their
gradients are summed in another order (measured: up to 6e-8 of scale); a wrong table or formula is off by O(1)."""


def _row_plan(kind: str, seed: int = 0):
    samples = [_sample(t) for t in TRIES[kind.replace("one_sequence", "nothing_shared")](random.Random(seed))]
    row = pack_samples(samples[:1] if kind == "one_sequence" else samples)
    return row, plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)


def _rule_inputs(n: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(n, 2, 8, generator=gen, dtype=torch.float64), dim=-1)
            for _ in range(2))
    return [q, k, torch.randn(n, 4, 4, generator=gen, dtype=torch.float64),
            -torch.rand(n, 4, generator=gen, dtype=torch.float64) * 0.2,
            torch.rand(n, 4, generator=gen, dtype=torch.float64)]


@pytest.mark.parametrize("kind", ROWS)
def test_the_rule_op_equals_the_per_level_driver(kind):
    """The op's output and gradients == grpo.kernels.gdn's per-level varlen driver over the token-by-token recurrence (fp64),
    on the row in level-major order; and torch.library's checks of its fake and autograd registrations pass."""
    from test_gdn import _varlen_sequential_rule

    from grpo.kernels.gdn import tree_varlen_gated_delta_rule

    row, plan = _row_plan(kind)
    inputs = _rule_inputs(row.num_tokens)
    tables = mixer_tables(plan)[4:]
    weights = torch.randn(row.num_tokens, 4, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in inputs]
    ordered = [t[plan.order] for t in leaves]
    out = gdn_tree_rule_op(*ordered, *tables)[0]
    got = [out[plan.unpermute], *torch.autograd.grad((out[plan.unpermute] * weights).sum(), leaves)]

    def rule(q, k, v, g, beta, **kw):
        q, k = (t.repeat_interleave(2, dim=2) for t in (q, k))
        return _varlen_sequential_rule(q, k, v, g, beta, **kw)

    leaves = [t.clone().requires_grad_() for t in inputs]
    ref = tree_varlen_gated_delta_rule(rule, *leaves, plan, use_qk_l2norm_in_kernel=False)
    want = [ref, *torch.autograd.grad((ref * weights).sum(), leaves)]
    for name, a, b in zip(["out", "dq", "dk", "dv", "dg", "dbeta"], got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    torch.library.opcheck(gdn_tree_rule_op, (*[t.clone().requires_grad_() for t in inputs], *tables),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.fixture(scope="module")
def gdn_layer(tiny_models):
    from transformers import AutoConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    layer = Qwen3_5GatedDeltaNet(AutoConfig.from_pretrained(tiny_models["qwen3_5"]).text_config, layer_idx=0).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(torch.rand(p.shape, generator=gen, dtype=p.dtype) * 2 + 1 if name == "A_log"
                    else torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return layer


def _varlen_reference(q, k, v, g, beta, use_qk_l2norm_in_kernel, **kw):
    """FLA's varlen signature over the token-by-token recurrence (q/k heads repeated to the value heads)."""
    from test_gdn import _varlen_sequential_rule

    q, k = (t.repeat_interleave(v.shape[2] // t.shape[2], dim=2) for t in (q, k))
    return _varlen_sequential_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kw)


def _mixer_vs_layer(layer, kind: str, mixer, seed: int = 0):
    """(mixer's [out, input grad, weight grads], the layer's own tree forward's) on one row, fp64. The layer takes
    its FLA path (q and k normalised in the conv, the recurrence per level) with the token-by-token recurrence
    standing in for FLA's kernel."""
    import grpo.kernels.gdn as gdn
    from grpo.kernels.gdn_choice import GdnKernels

    row, plan = _row_plan(kind, seed)
    hidden = torch.randn(row.num_tokens, layer.hidden_size, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float64)
    results = []
    for run in (lambda x: mixer(x, mixer_weights(layer), mixer_tables(plan),
                                (layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim),
                                float(layer.norm.variance_epsilon), not plan.level_major),
                lambda x: tree_gdn_forward(layer, x[None], plan)[0]):
        x = hidden.clone().requires_grad_()
        layer.zero_grad()
        choice = gdn.gdn_kernels
        gdn.gdn_kernels = lambda *a, **kw: (GdnKernels("fla", "fla", "test"), _varlen_reference)
        try:
            out = run(x)
        finally:
            gdn.gdn_kernels = choice
        out.square().sum().backward()
        results.append([out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()])
    return results


@pytest.mark.parametrize("kind", ROWS)
def test_the_mixer_formula_equals_the_layers_tree_forward(gdn_layer, kind):
    """`mixer_formula` (eager) == grpo.kernels.gdn's tree forward of the layer on rows in and out of level-major order, fp64:
    output, input and every weight gradient."""
    got, want = _mixer_vs_layer(gdn_layer, kind, mixer_formula)
    errors = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]
    assert max(errors) < GATE_ROUNDING, errors


def test_the_mixer_tables_recompute_at_least_one_conv_row():
    """A row of one sequence has no conv row to recompute; the mixer's tables still give it one (token 0 from its
    own window), as a zero length breaks inductor's Triton launch (torch 2.11). The mixer equals the layer there
    (`one_sequence` in ROWS)."""
    _, plan = _row_plan("one_sequence")
    assert plan.ordered_conv_fix_index.numel() == 0
    fix_index, fix_window = mixer_tables(plan)[2:4]
    assert fix_index.tolist() == [0] and torch.equal(fix_window, plan.ordered_conv_index[:1])


def test_the_mixer_compiles_once_for_rows_of_every_shape(gdn_layer):
    """Under torch.compile (aot_eager, dynamic) the mixer equals the layer's tree forward on three rows of different
    lengths, segment and level counts, and compiles one graph per value of `permute` (two), not one per row."""
    import torch._dynamo

    torch._dynamo.reset()
    compiled = torch.compile(mixer_formula, backend="aot_eager", dynamic=True)
    from torch._dynamo.utils import counters

    counters.clear()
    for seed, kind in enumerate(["multi_level", "shared_prompt", "multi_level", "shared_prompt"]):
        got, want = _mixer_vs_layer(gdn_layer, kind, compiled, seed)
        errors = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]
        assert max(errors) < GATE_ROUNDING, (kind, errors)
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])  # one graph: the op is opaque, nothing breaks


def test_the_mixer_leaves_adapted_layers_to_the_eager_forward(gdn_layer):
    """A projection that is not a plain bias-free Linear (a LoRA adapter, a bias) is not covered by the formula."""
    import copy

    layer = copy.deepcopy(gdn_layer)
    assert mixer_weights(layer) is not None
    layer.in_proj_z = torch.nn.Linear(layer.in_proj_z.in_features, layer.in_proj_z.out_features, bias=True)
    assert mixer_weights(layer) is None


@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_layers_gdn_through_build_policy_equals_eager(tiny_models, checkpointing, monkeypatch):
    """`compile_scope="layers_gdn"` through `build_policy` as train.py calls it (fp32 on CPU, inductor), for GDN
    layers not compiled whole (as with a sparse MLP): every GDN layer of the tiny Qwen3.5 runs the separately
    compiled mixer (the rule op's CPU reference standing in for FLA's one-pass rule) on rows of other shapes; its
    tree-packed log-probs and gradients equal the
    eager model's (FLA's per-level path, the token-by-token recurrence standing in for FLA), with and without
    gradient checkpointing."""
    from torch._dynamo.utils import counters

    import grpo.kernels.gdn as gdn
    import grpo.kernels.gdn_graph as gdn_graph
    from test_train import random_samples
    from test_tree_attention import assert_same_results

    calls = []
    monkeypatch.setattr(gdn_graph, "graph_gdn_forward", _counting(gdn_graph.graph_gdn_forward, calls))
    monkeypatch.setattr("grpo.model.whole_gdn_layers", lambda model: [])  # the decoder layers keep their regions
    rows = [pack_samples(random_samples(5)), pack_samples([_sample(t) for t in TRIES["multi_level"](random.Random(2))])]
    eager, compiled, _, model = _eager_then_layers_gdn(tiny_models, monkeypatch, rows,
                                                       gradient_checkpointing=checkpointing)
    n_gdn = sum(gdn.is_gdn_layer(m) for m in model.modules())
    assert n_gdn and sum(out is not None for out in calls) >= len(rows) * n_gdn  # every GDN forward in the graph
    assert not [r for r in counters["graph_break"] if "gdn" in r.lower()], dict(counters["graph_break"])
    assert_same_results(compiled, eager)


def _eager_then_layers_gdn(tiny_models, monkeypatch, rows, **config) -> tuple:
    """The tiny Qwen3.5 policy built twice through `build_policy` (fp32 on CPU) with FLA standing in as the
    token-by-token recurrence: eager on FLA's per-level path, then `compile_scope="layers_gdn"` with the one-pass
    rule (the rule op's CPU reference). Returns (eager `step_results` of `rows`, compiled ones, unique-graph counts
    after each compiled row, the compiled model); dynamo's counters hold the compiled run's."""
    import dataclasses
    import importlib

    from torch._dynamo.utils import counters

    import grpo.kernels.gdn as gdn
    import grpo.kernels.gdn_graph as gdn_graph
    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import DistInfo
    from grpo.kernels.gdn_choice import GdnKernels
    from grpo.policy import build_policy
    from test_tree_attention import step_results

    monkeypatch.setattr(gdn, "_COMPILED", {})  # process-wide compile state, put back after the test
    monkeypatch.setattr(gdn_graph, "_COMPILED", {})
    modeling = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    monkeypatch.setattr(modeling, "apply_rotary_pos_emb", modeling.apply_rotary_pos_emb)
    base = AsyncGRPOConfig(model=str(tiny_models["qwen3_5"]), **config)
    runs, graphs = [], []
    for one_pass, overrides in ((False, dict(compile_layers=False)),
                                (True, dict(compile_layers=True, compile_scope="layers_gdn"))):
        monkeypatch.setattr(gdn, "gdn_kernels", lambda *a, one_pass=one_pass, **kw: (
            GdnKernels("fla", "fla", "test", one_pass=one_pass), _varlen_reference))
        model, policy, *_ = build_policy(dataclasses.replace(base, **overrides), DistInfo(0, 1, 0, torch.device("cpu")),
                                         2048)
        counters.clear()
        runs.append([])
        for row in rows:
            runs[-1].append(step_results(model, policy, row))
            graphs.append(counters["stats"]["unique_graphs"])
    return runs[0], runs[1], graphs[len(rows):], model


def _counting(fn, calls: list):
    def counted(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.append(out)
        return out

    return counted


@pytest.mark.parametrize("checkpointing", ["false", "true"])
def test_gdn_layers_compiled_whole_equal_eager(tiny_models, checkpointing, monkeypatch):
    """`compile_scope="layers_gdn"` where FLA runs in one pass (standing in: the rule op's CPU reference) compiles the
    tiny Qwen3.5's GDN decoder layers whole (norms, mixer, MLP: one graph each way), the mixer read from the row's
    tables built before the decoder runs: log-probs and gradients equal the eager model's on three rows, no graph
    break at the mixer, and the third row (new sizes) compiles nothing new; with and without gradient checkpointing."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch._dynamo.utils import counters

    import grpo.kernels.gdn as gdn
    from grpo.kernels.gdn_plan import row_plan
    from grpo.model import whole_gdn_layers
    from test_train import random_samples
    from test_tree_attention import assert_same_results

    rows = [pack_samples(random_samples(5))] + [pack_samples([_sample(t) for t in TRIES["multi_level"](
        random.Random(seed))]) for seed in (2, 3)]
    eager, fast, graphs, model = _eager_then_layers_gdn(  # attention in its layers' graphs too (the CPU reference)
        tiny_models, monkeypatch, rows, gradient_checkpointing=checkpointing, attn_backend="flash_split")
    compiled = [layer for layer in whole_gdn_layers(model) if getattr(layer, "_compiled_call_impl", None)]
    assert compiled and len(compiled) == sum(gdn.is_gdn_layer(m) for m in model.modules())
    assert not counters["graph_break"], dict(counters["graph_break"])  # nothing breaks a compiled layer
    assert graphs[1] == graphs[2], graphs  # the third row reused the graphs
    # one graph per layer kind (GDN, attention) and permute value, not one per layer: dynamo's recompile limit (8) would
    # leave most of Qwen3.5-2B's 18 GDN layers eager
    permutes = {not row_plan(row, compiled[0].linear_attn.conv_kernel_size).level_major for row in rows}
    entries = _debug_get_cache_entry_list(type(compiled[0]).forward.__code__)
    assert 2 <= len(entries) <= 2 * len(permutes), (len(entries), permutes)
    assert_same_results(fast, eager)
