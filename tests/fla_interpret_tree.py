"""Run by tests/test_gdn_fla.py in a subprocess: grpo/kernels/gdn_fla.py's one-pass tree rule (`FlaTreeRule`: FLA's chunk
pipeline once over a trie row, its state kernels once per level) with FLA's Triton kernels executed by Triton's
interpreter on CPU (tests/fla_interpret.py), on packed trie rows of several shapes, fp32 inputs. Prints one JSON line:
per row, the largest error of the output and of the q, k, v, g, beta gradients, as a fraction of each value's
largest magnitude, against (1) the token-by-token recurrence along each segment's path in fp64 (the reference) and
(2) FLA's public kernel called once per level (`tree_varlen_gated_delta_rule`, the path it replaces); and whether
the plan's chunk tables equal FLA's own (`prepare_chunk_indices` / `prepare_chunk_offsets`). Then a Qwen3.5 GDN
layer through grpo/kernels/gdn.py's tree forward, one pass against per level (`layer_paths`), and grpo/kernels/gdn_choice.py's
run-time check of the rule (`settled`), and the Triton launches of one forward + backward each way (`launches`).

argv: repo, the folder holding `fla` (fla-core installed with --target).
"""

import json
import random
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fla_interpret import interpret_fla  # noqa: E402

copy = interpret_fla(*sys.argv[1:3])

import torch  # noqa: E402
from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: E402
from fla.ops.utils.index import prepare_chunk_indices, prepare_chunk_offsets  # noqa: E402

from grpo.kernels.gdn import plan_tree_scan, sequential_gated_delta_rule  # noqa: E402
from grpo.kernels.gdn_fla import fla_tree_kernels, tree_fla_gated_delta_rule, tree_varlen_gated_delta_rule  # noqa: E402
from grpo.samples import TrainingSample  # noqa: E402
from grpo.trie import pack_samples  # noqa: E402

H_K, H_V, D_K, D_V = 2, 4, 32, 16  # grouped heads: each key head serves two value heads
TERMS = ("out", "dq", "dk", "dv", "dg", "dbeta")


def sample(tokens):
    return TrainingSample(input_ids=tokens, completion_mask=[1] * len(tokens), sampler_logprobs=[0.0] * len(tokens),
                          advantage=1.0, group_id=0, model_version=0)


def rows():
    rng = random.Random(11)

    def tokens(n):
        return [rng.randrange(4, 1000) for _ in range(n)]

    def group(prompt_len, lengths):
        prompt = tokens(prompt_len)
        return [prompt + tokens(n) for n in lengths]

    deep = [tokens(90)]
    for _ in range(7):  # each new sample forks an earlier one at a random depth: several levels
        base = rng.choice(deep)
        deep.append(base[:rng.randrange(1, len(base))] + tokens(rng.randrange(2, 70)))
    return {
        "two groups of a shared prompt (not level-major)": group(70, [1, 19, 64, 3]) + group(130, [40, 66]),
        "one shared prompt (level-major)": group(150, [10, 65, 2]),
        "several levels": deep,
        "nothing shared (one level)": [tokens(n) for n in (5, 1, 80, 17)],
    }


def varlen_reference(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
                     use_qk_l2norm_in_kernel):
    """FLA's varlen signature over the token-by-token recurrence in fp64, the key heads repeated to the value heads."""
    q, k = (t.double().repeat_interleave(H_V // H_K, dim=2) for t in (q, k))
    v, g, beta = (t.double() for t in (v, g, beta))
    bounds = cu_seqlens_cpu.tolist()
    outs, finals = [], []
    for seg, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = None if initial_state is None else initial_state[seg:seg + 1].double()
        o, f = sequential_gated_delta_rule(*(t[:, lo:hi] for t in (q, k, v, g, beta)), initial_state=state,
                                           output_final_state=True, use_qk_l2norm_in_kernel=False)
        outs.append(o)
        finals.append(f)
    return torch.cat(outs, 1), torch.cat(finals, 0)


def inputs(n, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.nn.functional.normalize(torch.randn(n, H_K, D_K, generator=gen), dim=-1) for _ in range(2))
    return ([q, k, torch.randn(n, H_V, D_V, generator=gen), -torch.rand(n, H_V, generator=gen) * 0.2,
             torch.rand(n, H_V, generator=gen)], torch.randn(n, H_V, D_V, generator=gen))


def run(fn, xs, weights):
    leaves = [x.clone().requires_grad_() for x in xs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad((out.double() * weights.double()).sum(), leaves)]


def scale_error(got, want):
    return float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))


def check(samples, seed):
    row = pack_samples([sample(t) for t in samples])
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    xs, weights = inputs(row.num_tokens, seed)
    one_pass = run(lambda *t: tree_fla_gated_delta_rule(*t, plan), xs, weights)
    per_level = run(lambda *t: tree_varlen_gated_delta_rule(chunk_gated_delta_rule, *t, plan,
                                                            use_qk_l2norm_in_kernel=False), xs, weights)
    reference = run(lambda *t: tree_varlen_gated_delta_rule(varlen_reference, *t, plan), xs, weights)
    cu = plan.seg_cu_seqlens
    tables = (torch.equal(plan.chunk_indices, prepare_chunk_indices(cu, 64))
              and torch.equal(plan.chunk_offsets, prepare_chunk_offsets(cu, 64)))
    return {"levels": len(plan.levels), "level_major": plan.level_major, "tokens": row.num_tokens,
            "vs_reference": {t: scale_error(a, b) for t, a, b in zip(TERMS, one_pass, reference)},
            "vs_per_level": {t: scale_error(a, b) for t, a, b in zip(TERMS, one_pass, per_level)},
            "per_level_vs_reference": max(scale_error(a, b) for a, b in zip(per_level, reference)),
            "chunk_tables_equal_flas": tables}


def settled():
    """grpo/kernels/gdn_choice.py's run-time decision on the one-pass rule (fp32 probe inputs): its check passing, a
    one-pass rule 10 % off refused, and an fla-core whose state kernels take other arguments not used."""
    import grpo.kernels.gdn_choice as gdn_choice
    import grpo.kernels.gdn_fla as gdn_fla

    make_inputs, cpu = gdn_choice._probe_inputs, torch.device("cpu")
    gdn_choice._probe_inputs = lambda device, grad, *heads: [t.detach().float().requires_grad_(grad)
                                                             for t in make_inputs(device, grad, *heads)]
    kernels = gdn_choice.GdnKernels("fla", "fla", "probe")
    report = {"error": gdn_choice._check_one_pass(chunk_gated_delta_rule, cpu, (H_K, H_V, D_K, D_V), True),
              "passed": gdn_choice._settle_one_pass(kernels, chunk_gated_delta_rule, cpu, (H_K, H_V, D_K, D_V))}
    one_pass = gdn_fla.tree_fla_gated_delta_rule
    gdn_fla.tree_fla_gated_delta_rule = lambda *args: one_pass(*args) * 1.1
    report["off"] = gdn_choice._settle_one_pass(kernels, chunk_gated_delta_rule, cpu, (H_K, H_V, D_K, D_V))
    gdn_fla.tree_fla_gated_delta_rule = one_pass
    known, gdn_fla._FWD_H_ARGS = gdn_fla._FWD_H_ARGS, gdn_fla._FWD_H_ARGS[:-1]
    gdn_fla.fla_tree_kernels.cache_clear()
    report["other_fla"] = gdn_choice._settle_one_pass(kernels, chunk_gated_delta_rule, cpu, (H_K, H_V, D_K, D_V))
    gdn_fla._FWD_H_ARGS = known
    gdn_fla.fla_tree_kernels.cache_clear()
    return {name: r if isinstance(r, float) else [r.one_pass, r.describe()] for name, r in report.items()}


def layer_paths():
    """A Qwen3.5 GDN layer (small config, fp32, random weights) through grpo.kernels.gdn's tree forward on the two-group
    row, FLA in one pass against FLA per level (grpo/kernels/gdn.py's two FLA branches; the per-level one is checked
    against the unmodified layer per sample in tests/test_gdn.py): the largest error of the output and of every
    parameter's and the input's gradient, as a fraction of each one's scale."""
    import grpo.kernels.gdn as gdn
    from grpo.kernels.gdn_choice import GdnKernels
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    config = Qwen3_5TextConfig(hidden_size=64, linear_num_key_heads=H_K, linear_num_value_heads=H_V,
                               linear_key_head_dim=D_K, linear_value_head_dim=D_V, linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, layer_idx=0).float()
    row = pack_samples([sample(t) for t in next(iter(rows().values()))])
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    hidden = torch.randn(1, row.num_tokens, 64)
    results = []
    for one_pass in (True, False):
        gdn.gdn_kernels = lambda *a, one_pass=one_pass: (GdnKernels("fla", "fla", "t", one_pass=one_pass),
                                                           chunk_gated_delta_rule)
        x = hidden.clone().requires_grad_()
        layer.zero_grad()
        out = gdn.tree_gdn_forward(layer, x, plan)
        out.square().sum().backward()
        results.append([out.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()])
    return max(scale_error(a, b) for a, b in zip(*results))


def launches(samples):
    """Triton kernel launches of one forward + backward of the recurrence on a row: (one pass, per level)."""
    import triton.runtime.interpreter as interpreter

    row = pack_samples([sample(t) for t in samples])
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    xs, weights = inputs(row.num_tokens, 0)
    counts = []
    launch = interpreter.InterpretedFunction.run
    for fn in (lambda *t: tree_fla_gated_delta_rule(*t, plan),
               lambda *t: tree_varlen_gated_delta_rule(chunk_gated_delta_rule, *t, plan, use_qk_l2norm_in_kernel=False)):
        count = [0]

        def counted(self, *args, count=count, **kwargs):
            count[0] += 1
            return launch(self, *args, **kwargs)

        interpreter.InterpretedFunction.run = counted
        try:
            run(fn, xs, weights)
        finally:
            interpreter.InterpretedFunction.run = launch
        counts.append(count[0])
    return {"levels": len(plan.levels), "one_pass": counts[0], "per_level": counts[1]}


assert fla_tree_kernels() is not None, "this fla-core's internals are not the ones grpo/kernels/gdn_fla.py launches"
rows_checked = {name: check(samples, seed) for seed, (name, samples) in enumerate(rows().items())}
print(json.dumps({"rows": rows_checked, "layer_one_pass_vs_per_level": layer_paths(), "settled": settled(),
                  "launches": {name: launches(samples) for name, samples in rows().items()}}))
shutil.rmtree(copy, ignore_errors=True)
