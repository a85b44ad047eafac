"""The Gated DeltaNet recurrence of one layer on one trainer row, per kernel: time, memory and error.

    python scripts/bench_gdn.py                          # Qwen3.5-2B GDN shapes, tree (ratio 3.4) and plain rows
    python scripts/bench_gdn.py --variants torch fla --compile
    python scripts/bench_gdn.py --variants fla-own fla-one-pass    # FLA per trie level vs in one pass per row
    python scripts/bench_gdn.py --device cpu --token-budget 1500 --prompt-len 300 --completion-len 60   # smoke test
    python scripts/bench_gdn.py --conv --variants torch  # also the tree conv vs its gather definition, side by side

A row is what the trainer forwards (scripts/bench_step.py's workload: groups of 8 rollouts, 1068-token prompts,
256-token completions, up to --token-budget unique tokens): `tree` packs each group's prompt once (a two-level
segment tree), `plain` packs every rollout alone. The timed unit is the recurrence of one GDN layer over the
whole row, as grpo/kernels/gdn.py's tree forward runs it (per trie level: gather, kernel, scatter), with bf16 q/k/v/beta
and fp32 g, as FSDP2 mixed precision hands them over. Head counts and dims are Qwen3.5-2B's public config
(bench_step.SHAPES); the ms x layers column multiplies fwd+bwd by the model's GDN layer count.

Variants: torch (grpo.kernels.gdn.chunk_gated_delta_rule, the default torch path: bf16 matmul operands, fp32 decays,
inverse and state), torch-fp32mm (the same with fp32 operands), torch-compiled (--compile: its state-free
regions under torch.compile), sequential (the token-by-token reference kernel), transformers (transformers'
torch_chunk_gated_delta_rule per padded level, the previous torch path; skipped when fla imports, because the
name is then FLA's kernel), fla (FLA's varlen kernel; where grpo.kernels.gdn.fla_directions refuses its backward on
this Triton/GPU, the backward runs with FLA's chunk_bwd_dqkwg step in torch, grpo/kernels/gdn_dqkwg.py). Errors: max |x - ref| / max |ref| of the output and of the gradients of q, k, v, g, beta, ref =
the sequential kernel in fp32 on the same (bf16-valued) inputs.

--conv also times the layer's causal conv over the row (C = 2 key dims + value dim channels, K_c = 4, bf16 in
fp32 accumulation): grpo.kernels.gdn.tree_causal_conv1d eager (contiguous shifted multiply-adds, segment starts
recomputed) and compiled (its formula under torch.compile, what train.py runs with compile_layers on) against its
definition, K_c gathers through the path index table with autograd's scatter backward (the trainer's conv until
2026-12-02).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

TERMS = ["out", "dq", "dk", "dv", "dg", "dbeta"]


def build_row(args, shared: bool):
    """One packed row of the bench_step workload, filled to the token budget."""
    from bench_groups import synthetic_groups

    from grpo.trie import pack_samples

    source = synthetic_groups(1000, shared, 0, group_size=args.group_size, prompt_len=args.prompt_len,
                              completion_len=args.completion_len)
    samples: list = []
    while True:
        group = list(itertools.islice(source, args.group_size))
        trial = pack_samples(samples + group, share_prefixes=shared)
        if samples and trial.num_tokens > args.token_budget:
            break
        samples += group
        if trial.num_tokens >= args.token_budget:
            break
    return pack_samples(samples, share_prefixes=shared)


def make_inputs(n: int, h_k: int, h_v: int, d_k: int, d_v: int, device, seed: int = 0):
    """q, k [N, H_k, D_k], v [N, H_v, D_v], beta [N, H_v] in bf16, g [N, H_v] in fp32; loss weights [N, H_v, D_v]."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(n, h_k, d_k, device=device, generator=gen).bfloat16()
    k = torch.randn(n, h_k, d_k, device=device, generator=gen).bfloat16()
    v = torch.randn(n, h_v, d_v, device=device, generator=gen).bfloat16()
    g = -torch.rand(n, h_v, device=device, generator=gen) * 0.3
    beta = torch.rand(n, h_v, device=device, generator=gen).bfloat16()
    weights = torch.randn(n, h_v, d_v, device=device, generator=gen)
    return [q, k, v, g, beta], weights


def variants(names: list[str], device):
    """name -> (recurrence(q, k, v, g, beta, plan) -> out, backward_ok, note), for the names that can run here."""
    import torch

    from grpo.kernels import gdn

    def padded(rule):
        def run(q, k, v, g, beta, plan):
            rep = v.shape[1] // q.shape[1]
            return gdn.tree_chunk_gated_delta_rule(rule, q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1),
                                                   v, g, beta, plan)
        return run

    fla_importable = importlib.util.find_spec("fla") is not None
    out = {}
    for name in names:
        if name == "torch":
            out[name] = (padded(gdn.chunk_gated_delta_rule), True, "")
        elif name == "torch-fp32mm":
            out[name] = (padded(functools.partial(gdn.chunk_gated_delta_rule, matmul_dtype=torch.float32)), True, "")
        elif name == "torch-compiled":
            out[name] = (padded(lambda *a, **kw: gdn.chunk_gated_delta_rule(*a, **kw)), True, "compiled regions")
        elif name == "sequential":
            out[name] = (padded(gdn.sequential_gated_delta_rule), True, "")
        elif name == "transformers":
            if fla_importable:
                print("transformers: skipped (fla imports, so transformers' torch_chunk_gated_delta_rule is FLA's)")
                continue
            from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

            out[name] = (padded(torch_chunk_gated_delta_rule), True, "")
        elif name in ("fla", "fla-own", "fla-one-pass"):
            if device.type != "cuda" or not fla_importable:
                print(f"{name}: skipped (needs CUDA and fla-core)")
                continue
            out[name] = _fla_variant(name, device)
        else:
            raise SystemExit(f"unknown variant {name}")
    return out


def _fla_variant(name: str, device):
    """FLA's varlen kernels. Where FLA refuses its gated dqkwg step (Triton >= 3.4, < 3.7.1 on Hopper), `fla` runs
    that step in torch (grpo/kernels/gdn_dqkwg.py) and `fla-own` runs FLA's own past its guard (grpo/kernels/gdn_choice.py's
    `unguarded_fla_dqkwg`; the error columns say whether it is right at these head sizes). The step is put in at
    each call: the variants share FLA's module. `fla-one-pass` is grpo/kernels/gdn_fla.py's one-pass tree rule (FLA's chunk
    pipeline once per row, its state kernels per level; FLA's own dqkwg step past its guard where it is refused, as
    `fla-own`), q and k L2-normalised by torch before it (the trainer normalises them in the tree conv); `fla` and
    `fla-own` call FLA once per level with its in-kernel normalisation."""
    import torch
    import triton
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule

    import grpo.kernels.gdn as gdn
    from grpo.kernels.gdn_choice import _set_dqkwg, flas_own_dqkwg, unguarded_fla_dqkwg

    _, backward_ok, reason = gdn.fla_directions(triton.__version__, torch.cuda.get_device_capability(device))
    step, note = None, ""
    if not backward_ok:
        flas_own = flas_own_dqkwg()  # None: this FLA's step cannot be replaced
        if flas_own is not None:
            from grpo.kernels.gdn_dqkwg import chunk_bwd_dqkwg

            step = chunk_bwd_dqkwg if name == "fla" else unguarded_fla_dqkwg(flas_own)
        backward_ok = step is not None
        note = (f"{reason}; its chunk_bwd_dqkwg step " + ("in torch (grpo/kernels/gdn_dqkwg.py)" if name == "fla"
                                                            else "FLA's own, past its guard")
                if backward_ok else f"backward refused: {reason}")
        print(f"{name}: {note}")
    rule = functools.partial(gdn.tree_varlen_gated_delta_rule, fla_rule)
    if name == "fla-one-pass":
        if gdn.fla_tree_kernels() is None:
            raise SystemExit("fla-one-pass: this fla-core's state kernels are not the ones grpo/kernels/gdn_fla.py launches")
        rule = _one_pass_rule
    if step is None:
        return rule, backward_ok, note

    def with_step(*args, **kwargs):
        _set_dqkwg(step)  # read again by FLA's backward when it runs
        return rule(*args, **kwargs)

    return with_step, backward_ok, note


def _one_pass_rule(q, k, v, g, beta, plan):
    """grpo/kernels/gdn_fla.py's one-pass rule with q and k L2-normalised first (FLA's formula), as the tree conv does."""
    from grpo.kernels.gdn import tree_fla_gated_delta_rule
    from grpo.kernels.gdn_kernel import l2norm

    q, k = (l2norm(x.float()).to(x.dtype) for x in (q, k))
    return tree_fla_gated_delta_rule(q, k, v, g, beta, plan)


def sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_once(fn, inputs, weights, plan, backward: bool):
    """(out, grads or None) of one call; inputs are cloned leaves."""
    import torch

    xs = [t.detach().clone().requires_grad_(backward) for t in inputs]
    with torch.set_grad_enabled(backward):
        out = fn(*xs, plan)
        if not backward:
            return out, None
        (out.float() * weights).sum().backward()
    return out, [t.grad for t in xs]


def time_ms(fn, inputs, weights, plan, backward: bool, reps: int, warmup: int, device, label: str = "") -> float:
    """Median ms of `reps` calls after `warmup`; the warm-up calls' times go to stderr (compile / autotune cost)."""
    times = []
    for i in range(warmup + reps):
        sync(device)
        t0 = time.perf_counter()
        run_once(fn, inputs, weights, plan, backward)
        sync(device)
        if i < warmup:
            print(f"  {label} {'fwd+bwd' if backward else 'fwd'} warm-up call {i}: {time.perf_counter() - t0:.2f} s",
                  file=sys.stderr, flush=True)
        else:
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def scale_error(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def bench_row(row_kind: str, row, args, device, dims, n_layers: int) -> list[dict]:
    import torch

    from grpo.kernels import gdn
    from grpo.kernels.gdn import plan_tree_scan

    row = row.to(device)
    plan = plan_tree_scan(row.token_pred, row.cu_seqlens_q, row.seg_parent, 4)
    levels = ", ".join(f"{int(lv.gather_index.shape[0])}x{int(lv.gather_index.shape[1])}" for lv in plan.levels)
    print(f"\n{row_kind}: {row.num_tokens} tokens, {row.num_segments} segments, levels (segments x padded length): "
          f"{levels}", flush=True)
    inputs, weights = make_inputs(row.num_tokens, *dims, device)
    reference_inputs = [t.float() for t in inputs]  # the same values, fp32
    ref_out, ref_grads = run_once(padded_reference(), reference_inputs, weights, plan, backward=True)
    reference = [ref_out] + ref_grads
    results = []
    for name, (fn, backward_ok, note) in variants(args.variants, device).items():
        compiled_regions(gdn, name == "torch-compiled")
        slow = name in ("sequential", "transformers")
        reps, warmup = (1, 1) if slow else (args.reps, args.warmup)
        r = {"row": row_kind, "variant": name, "note": note, "layers": n_layers}
        r["fwd_ms"] = time_ms(fn, inputs, weights, plan, False, reps, warmup, device, name)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        if backward_ok:
            r["fwd_bwd_ms"] = time_ms(fn, inputs, weights, plan, True, reps, warmup, device, name)
            out, grads = run_once(fn, inputs, weights, plan, backward=True)
            errors = [scale_error(a, b) for a, b in zip([out] + grads, reference)]
        else:
            r["fwd_bwd_ms"] = float("nan")
            out, _ = run_once(fn, inputs, weights, plan, backward=False)
            errors = [scale_error(out, reference[0])] + [float("nan")] * 5
        r["peak_mib"] = ((torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda"
                         else float("nan"))
        r.update(zip(TERMS, errors))
        results.append(r)
        print("RESULT " + json.dumps(r), flush=True)
    compiled_regions(gdn, False)
    return results


def bench_conv(row_kind: str, row, args, device, dims, n_layers: int) -> dict:
    """fwd+bwd ms of the tree conv and of its gather definition on one row (see the module docstring)."""
    import torch

    from grpo.kernels.gdn import conv_fix_index, conv_index_table, tree_causal_conv1d

    row = row.to(device)
    index = conv_index_table(row.token_pred, 4)
    fix = conv_fix_index(index)
    channels = 2 * dims[0] * dims[2] + dims[1] * dims[3]
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(row.num_tokens, channels, device=device, generator=gen).to(torch.bfloat16)
    weight = torch.randn(channels, 4, device=device, generator=gen).to(torch.bfloat16)

    def gathers(a, w, _plan):
        a_padded = torch.cat([a, a.new_zeros(1, a.shape[1])])
        acc = torch.promote_types(a.dtype, torch.float32)
        out = sum(a_padded[index[:, i]].to(acc) * w[:, i].to(acc) for i in range(4))
        return torch.nn.functional.silu(out.to(w.dtype))

    def tree(a, w, _plan):
        return tree_causal_conv1d(a, w, None, "silu", index, fix)

    def compiled(a, w, _plan):  # what train.py runs with compile_layers on (the default on CUDA)
        with compiled_conv():
            return tree_causal_conv1d(a, w, None, "silu", index, fix)

    variants = (("gathers", gathers), ("tree", tree), ("compiled", compiled))
    r = {"row": row_kind, "kernel": "conv", "channels": channels, "fix_rows": int(fix.numel()), "layers": n_layers}
    weights = torch.randn(row.num_tokens, channels, device=device, generator=gen)
    for name, fn in variants:
        r[f"{name}_ms"] = time_ms(fn, [x, weight], weights, None, True, args.reps, args.warmup, device, f"conv {name}")
    out, grads = run_once(gathers, [x.double(), weight.double()], weights, None, True)  # the definition in fp64
    for name, fn in variants:
        got, got_grads = run_once(fn, [x, weight], weights, None, True)
        r[f"{name}_error"] = max(scale_error(a, b) for a, b in zip([got] + got_grads, [out] + grads))
    print(f"CONV {row_kind}: {row.num_tokens} tokens x {channels} channels ({r['fix_rows']} rows recomputed): "
          f"fwd+bwd per layer gathers {r['gathers_ms']:.2f} ms, tree {r['tree_ms']:.2f} ms, compiled "
          f"{r['compiled_ms']:.2f} ms ({r['gathers_ms'] / r['compiled_ms']:.2f}x the gathers); max error vs the fp64 "
          f"definition (output, grads): gathers {r['gathers_error']:.1e}, tree {r['tree_error']:.1e}, compiled "
          f"{r['compiled_error']:.1e} of scale", flush=True)
    return r


@contextlib.contextmanager
def compiled_conv():
    """Inside: grpo.kernels.gdn.tree_causal_conv1d runs its torch.compile'd formula (compiled once, kept for reuse)."""
    import grpo.kernels.gdn as gdn

    saved = dict(gdn._COMPILED)
    gdn.compile_tree_conv()
    try:
        yield
    finally:
        gdn._COMPILED.clear()
        gdn._COMPILED.update(saved)


_REGIONS: dict = {}


def compiled_regions(_, on: bool) -> None:
    """Swap the torch kernel's state-free regions (grpo/kernels/gdn_kernel.py) between eager and torch.compile'd (compiled
    once, kept for reuse)."""
    import grpo.kernels.gdn_kernel as gdn

    if not _REGIONS:
        _REGIONS["eager"] = (gdn._chunk_prepare, gdn._chunk_output)
    if on and "compiled" not in _REGIONS:
        gdn.compile_chunk_regions()
        _REGIONS["compiled"] = (gdn._chunk_prepare, gdn._chunk_output)
    gdn._chunk_prepare, gdn._chunk_output = _REGIONS["compiled" if on else "eager"]


def padded_reference():
    from grpo.kernels import gdn

    def run(q, k, v, g, beta, plan):
        rep = v.shape[1] // q.shape[1]
        return gdn.tree_chunk_gated_delta_rule(gdn.sequential_gated_delta_rule, q.repeat_interleave(rep, 1),
                                               k.repeat_interleave(rep, 1), v, g, beta, plan)
    return run


def print_table(results: list[dict]) -> None:
    head = (f"{'row':<6} {'variant':<15} {'fwd ms':>8} {'fwd+bwd':>8} {'x layers':>9} {'peak MiB':>9} "
            + " ".join(f"{t:>8}" for t in TERMS) + "  note")
    print("\n" + head + "\n" + "-" * len(head))
    for r in results:
        print(f"{r['row']:<6} {r['variant']:<15} {r['fwd_ms']:>8.2f} {r['fwd_bwd_ms']:>8.2f} "
              f"{r['fwd_bwd_ms'] * r['layers']:>9.1f} {r['peak_mib']:>9.0f} "
              + " ".join(f"{r[t]:>8.1e}" for t in TERMS) + f"  {r['note']}")
    print("errors: max |x - ref| / max |ref|, ref = sequential in fp32 on the same inputs; outputs and gradients "
          "are bf16 (the inputs' dtype), so the `sequential` row (bf16 in/out) is the floor. x layers = fwd+bwd x "
          "GDN layers (ms per step); peak MiB = CUDA memory above the inputs during fwd+bwd")


def main() -> None:
    import torch

    from bench_step import SHAPES
    from grpo.model import cache_triton_autotuning

    cache_triton_autotuning()  # before fla imports, as the trainer does

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="Qwen3.5-2B", choices=[s for s, (kind, _) in SHAPES.items() if kind == "qwen3_5"])
    p.add_argument("--rows", nargs="+", default=["tree", "plain"], choices=["tree", "plain"])
    p.add_argument("--variants", nargs="+",
                   default=["torch", "torch-fp32mm", "sequential", "transformers", "fla", "fla-own", "fla-one-pass"],
                   choices=["torch", "torch-fp32mm", "torch-compiled", "sequential", "transformers", "fla", "fla-own",
                            "fla-one-pass"])
    p.add_argument("--compile", action="store_true", help="also time torch-compiled (runs last: it compiles "
                                                          "grpo.kernels.gdn's regions for the rest of the process)")
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1068)
    p.add_argument("--completion-len", type=int, default=256)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--conv", action="store_true", help="also time the tree conv against its gather definition")
    args = p.parse_args()
    if args.compile and "torch-compiled" not in args.variants:
        args.variants.append("torch-compiled")
    if "torch-compiled" in args.variants:  # after every eager variant
        args.variants = [v for v in args.variants if v != "torch-compiled"] + ["torch-compiled"]
    device = torch.device(args.device)
    text = SHAPES[args.shape][1]
    dims = (text["linear_num_key_heads"], text["linear_num_value_heads"], text["linear_key_head_dim"],
            text["linear_value_head_dim"])
    n_layers = sum(t == "linear_attention" for t in text["layer_types"])
    versions = f"torch {torch.__version__}"
    if importlib.util.find_spec("triton") is not None:
        import triton

        versions += f", triton {triton.__version__}"
    if importlib.util.find_spec("fla") is not None:
        import fla

        versions += f", fla {getattr(fla, '__version__', '?')}"
    gpu = torch.cuda.get_device_name(device) + f" sm_{''.join(map(str, torch.cuda.get_device_capability(device)))}" \
        if device.type == "cuda" else "cpu"
    print(f"{args.shape} GDN: H_k={dims[0]} H_v={dims[1]} D_k={dims[2]} D_v={dims[3]}, {n_layers} GDN layers; "
          f"{gpu}; {versions}", flush=True)
    results = []
    convs = []
    for kind in args.rows:
        row = build_row(args, shared=kind == "tree")
        if args.conv:
            convs.append(bench_conv(kind, row, args, device, dims, n_layers))
        results += bench_row(kind, row, args, device, dims, n_layers)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results + convs, indent=1))


if __name__ == "__main__":
    main()
