"""The trainer step `train.py` runs, timed: trained tokens/s, MFU, peak memory and where the time goes.

    python scripts/bench_step.py --shape Qwen3-1.7B --ratio 1 3.4            # 1 GPU: tree and plain, side by side
    python scripts/bench_step.py --shape Qwen3-1.7B --ratio 1 --set compile_layers=false gradient_checkpointing=true
    python scripts/bench_step.py --shape Qwen3-0.6B --ratio 1 --set bench_split_in_graph=false  # eager split vs op
    python scripts/bench_step.py --shape Qwen3-0.6B --ratio 1 --set bench_cpp_wrapper=true  # kernels launched from C++
    python scripts/bench_step.py --shape Qwen3.5-2B --ratio 3.4 --set bench_gdn_per_level=true  # FLA per trie level too
    python scripts/bench_step.py --shape Qwen3.5-2B --ratio 3.4 --set compile_scope=layers  # GDN layers not compiled whole
    python scripts/bench_step.py --shape Qwen3-1.7B --ratio 3.4 --set bench_split_grouped=true  # split's part 2 gathered
    python scripts/bench_step.py --shape Qwen3-1.7B --ratio 3.4 --set bench_merge_compiled=true  # inductor's merge
    python scripts/bench_step.py --shape Qwen3-0.6B --ratio 1 --modes tree --profile --trace /tmp/q06.json  # timeline
    python scripts/bench_step.py --shape Qwen3-0.6B --ratio 1 --sync-every 1  # each step read back before the next
    torchrun --nproc-per-node 4 scripts/bench_step.py --shape Qwen3-1.7B      # N GPUs, FSDP2

Nothing here re-implements the step: the model is written to disk (random weights at a public shape) and loaded by
`build_policy` in grpo/policy.py (from_pretrained, dropout off, regional compile, FSDP2 mixed precision,
gradient-checkpointing policy, fused AdamW), micro-batches come from the real `TokenBudgetBatcher` fed with
synthetic groups, and each step is `train_micro_batch` + `queue_optimizer_step` (grpo/step.py) with the run's
default loss, queued and concluded as train.py's loop does: between barriers (`--sync-every`) the next step is
planned, packed and its forward queued before the previous one is read back. Workloads (bench_packing's): groups
of 8 rollouts, 1068-token prompts, 256-token completions; `--ratio 3.4` shares each group's prompt (trie packing
ratio ~3.4), `--ratio 1` gives every rollout its own prompt (nothing to share). Mode `plain` packs the same samples
without prefix sharing (the baseline the trie is measured against; a bench-only switch).

Columns: trained tok/s (completion tokens trained per second: the comparable number across modes), forwarded
tok/s, MFU (grpo/flops.py: causal attention, head on trained tokens only, peak 989 TFLOP/s bf16), peak GiB, and
the breakdown of a step in ms: fwd, bwd (fwd+bwd - fwd), head (the chunked log-prob head alone, fwd+bwd, timed in
isolation on the same shapes), opt (clip + AdamW), host (the rest of the step's wall time: batching, packing,
copies; with steps queued ahead it overlaps the device's work, and is near 0 when the device never waits), and on
the host's clock: plan (the batcher closing the micro-batch), pack (`pack_samples` building the row) and queue (the
host's time queuing the step, packing included; near the wall time per step: host-bound, or the host ran ahead and
waited on CUDA's full launch queue, which fwd against the GPU's own forward time tells apart). Below the
table, on a GPU: the head timed again with 4 GiB of kept logits and recomputing them all (`HEAD_VARIANTS`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_check import check_packed_vs_unpacked  # noqa: E402
from bench_groups import synthetic_groups  # noqa: E402
from bench_patches import (BENCH_SWITCHES, gdn_per_level, inductor_cpp_wrapper, merge_compiled,  # noqa: E402
                           plain_packing, split_attention_eager, split_grouped, timed_packing)

QWEN3 = dict(vocab_size=151_936, tie_word_embeddings=True, num_key_value_heads=8, head_dim=128)
SHAPES = {  # public configs' text stacks
    "Qwen3-0.6B": ("qwen3", dict(QWEN3, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16)),
    "Qwen3-1.7B": ("qwen3", dict(QWEN3, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16)),
    "Qwen3.5-2B": ("qwen3_5", dict(vocab_size=248_320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                   linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                                   linear_value_head_dim=128, linear_conv_kernel_dim=4,
                                   layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
                                   tie_word_embeddings=True)),
    # Qwen3-0.6B's 28 layers at tiny widths: on CPU mostly host work, what a small model's GPU step can wait on
    "host-qwen3": ("qwen3", dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=28,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)),
    "tiny": ("qwen3", dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)),
    "tiny-qwen3.5": ("qwen3_5", dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                     linear_value_head_dim=32, linear_conv_kernel_dim=4,
                                     layer_types=["linear_attention"] * 3 + ["full_attention"],
                                     tie_word_embeddings=False)),
}


def write_model(shape: str, out: Path) -> Path:
    """Random weights at `shape`, saved with save_pretrained (bf16 on disk; the trainer loads fp32 masters)."""
    import torch
    import transformers as tf

    path = out / shape
    if (path / "config.json").exists():
        return path
    kind, text = SHAPES[shape]
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "qwen3":
        cfg = tf.Qwen3Config(**text)
        build = tf.Qwen3ForCausalLM
    else:  # the VLM class users load for Qwen/Qwen3.5-*, with a small frozen vision tower
        vision = dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=16, num_position_embeddings=64)
        v = text["vocab_size"]
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=v - 4, video_token_id=v - 3,
                               vision_start_token_id=v - 2, vision_end_token_id=v - 1,
                               tie_word_embeddings=text["tie_word_embeddings"])
        build = tf.Qwen3_5ForConditionalGeneration
    with torch.device(device):
        model = build(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    return path


def next_plan(batcher, source):
    """Rank 0: feed samples to the real batcher until it closes a micro-batch (`plan_micro_batch`'s job)."""
    from grpo.step_plan import StepPlan

    while (rows := batcher.add(next(source))) is None:
        pass
    return StepPlan(rows, sum(s.num_trained for r in rows for s in r), batcher.last_stats.as_metrics())


HEAD_VARIANTS = {"with 4 GiB of logits kept (the budget before 2026-12-04d, chunks)": 4 << 30, "recomputing all": 0}


def head_ms(model, m: int, keep_logits_bytes: int, fused: bool, reps: int = 5) -> float:
    """The chunked log-prob head alone (fwd + bwd) on M trained positions, bf16, with the policy's head options."""
    import torch

    from grpo.kernels.logprobs import policy_token_logprobs
    from grpo.tree_attention import lm_head_weight

    if not torch.cuda.is_available() or m == 0:
        return float("nan")
    w = lm_head_weight(model).detach()
    w = (w.full_tensor() if hasattr(w, "full_tensor") else w).to(torch.bfloat16).requires_grad_(True)
    h = torch.randn(m, w.shape[1], device=w.device, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, w.shape[0], (m,), device=w.device)
    times = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logp, _, _ = policy_token_logprobs(h, w, targets, 1.0, keep_logits_bytes=keep_logits_bytes, fused=fused)
        logp.sum().backward()
        torch.cuda.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def run_case(model_dir: Path, ratio: float, mode: str, overrides: dict, args, info) -> dict:
    """One row of the table: build the policy for `overrides`, run `--warmup` + `--steps` trainer steps on the
    `ratio` workload in `mode` (two more under the profiler with --profile, first case only), return the figures."""
    import torch

    from grpo.config import AsyncGRPOConfig
    from grpo.policy import build_policy

    fields = {k: v for k, v in overrides.items() if k not in BENCH_SWITCHES}
    config = dataclasses.replace(AsyncGRPOConfig(model=str(model_dir), token_budget=args.token_budget), **fields)
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    case = {"shape": args.shape, "ratio": ratio, "mode": mode, "overrides": overrides, "ranks": info.world_size,
            "sync_every": args.sync_every}
    with contextlib.ExitStack() as stack:
        if mode == "plain":
            stack.enter_context(plain_packing())
        if overrides.get("bench_split_in_graph", True) is False:
            stack.enter_context(split_attention_eager())
        if overrides.get("bench_cpp_wrapper", False) is True:
            stack.enter_context(inductor_cpp_wrapper())
        if overrides.get("bench_gdn_per_level", False) is True:
            stack.enter_context(gdn_per_level())
        if overrides.get("bench_split_grouped", False) is True:
            stack.enter_context(split_grouped())
        if overrides.get("bench_merge_compiled", False) is True:
            stack.enter_context(merge_compiled())
        t_build = time.perf_counter()
        model, policy, optimizer, scheduler, autocast = build_policy(config, info, args.token_budget)
        build_s = time.perf_counter() - t_build
        vocab = model.config.get_text_config().vocab_size
        top_k = config.num_sampler_logprobs  # what the loss declared it needs
        profiler = _profiler(args.profile and not _PROFILED)
        source = _ready_samples(vocab, ratio, top_k, args)
        warmup = args.warmup + (0 if _WARMED else args.first_warmup)  # the process's first case warms up longer
        _WARMED.append(True)
        totals = _timed_steps((policy, optimizer, scheduler, autocast), config, info, source, profiler, args, warmup)
        if profiler is not None:
            _PROFILED.append(True)
            from profile_sites import print_profile
            from trace_gaps import write_trace

            print_profile(profiler, f"{args.shape} ratio {ratio} {mode} {overrides or 'defaults'}", cuda)
            if args.trace is not None:
                write_trace(profiler, args.trace)
    result = _case_result(case, totals, build_s, model, policy, info, args.steps)
    del model, policy, optimizer, scheduler
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def _ready_samples(vocab: int, ratio: float, top_k: int, args):
    """All the run's samples, generated before timing (train.py gets its samples ready-made from the rollout
    worker, with their numpy arrays attached as it publishes them): shared prompts when `ratio` > 1.5."""
    per_step = 3 * args.token_budget // args.prompt_len + 16
    samples = itertools.islice(synthetic_groups(vocab, shared=ratio > 1.5, top_k=top_k, prompt_len=args.prompt_len,
                                                completion_len=args.completion_len),
                               per_step * (args.warmup + args.first_warmup + args.steps + 3))
    return iter([s.with_arrays() for s in samples])


def _timed_steps(trainer: tuple, config, info, source, profiler, args, warmup: int) -> dict:
    """`warmup` + `--steps` trainer steps (two more under `profiler` when given), queued and concluded as train.py's
    loop does; sums over the timed steps: tokens (trained, forwarded, raw, attended, head), seconds (fwd, fwd_bwd,
    opt, plan, pack), and their wall time: from an idle device (the last warm-up step concluded) to the last timed
    step's conclusion (a step queued ahead is concluded when the host gets to it, so only the span is exact)."""
    from grpo.batcher import TokenBudgetBatcher
    from grpo.losses import loss_function

    loss_fn = loss_function(config.loss)
    batcher = TokenBudgetBatcher(args.token_budget, info.world_size)
    totals = dict(trained=0, forwarded=0, raw=0, attended=0, head=0, fwd=0.0, fwd_bwd=0.0, opt=0.0, wall=0.0,
                  plan=0.0, pack=0.0, queue=0.0)
    clock = {"end": time.perf_counter()}  # when the last step was concluded
    timed = range(warmup, warmup + args.steps)
    n_steps, pending = warmup + args.steps + (2 if profiler is not None else 0), None
    for step in range(n_steps):
        if step == warmup + args.steps:  # two extra steps under the profiler, after the timed ones
            profiler.__enter__()
        if step == timed.start:
            clock["timed"] = time.perf_counter()
        previous = pending
        pending = _queue_step(trainer, config, loss_fn, batcher, source, info, step,
                              lambda: previous and _conclude(trainer, previous, warmup, args, totals, clock))
        # a barrier (train.py: a weight sync, a checkpoint, the last step): concluded now, before the next plan
        if (step in (timed.start - 1, timed.stop - 1, n_steps - 1)
                or (args.sync_every and (step + 1) % args.sync_every == 0)):
            _conclude(trainer, pending, warmup, args, totals, clock)
            pending = None
        if step == timed.stop - 1:
            totals["wall"] = clock["end"] - clock["timed"]
    if profiler is not None:
        profiler.__exit__(None, None, None)
    return totals


def _queue_step(trainer: tuple, config, loss_fn, batcher, source, info, step: int, before_optimizer) -> dict:
    """One step as train.py's `queue_step` runs it: rank 0 plans the micro-batch and broadcasts it, every rank
    queues its row's forward/backward, `before_optimizer` (the previous step's conclusion), then the optimizer."""
    from grpo.distributed import broadcast_object
    from grpo.step import queue_optimizer_step, train_micro_batch

    policy, optimizer, scheduler, autocast = trainer
    packs: list[float] = []
    t0 = time.perf_counter()
    plan = broadcast_object(next_plan(batcher, source) if info.is_main else None, info)
    plan_s = time.perf_counter() - t0
    with timed_packing(packs):
        m = train_micro_batch(policy, plan.rows[info.rank], plan, loss_fn, config.loss, info.world_size, 1,
                              autocast, config.max_completion_length)
    queue_s = time.perf_counter() - t0 - plan_s  # the host's time queuing the step (packing included), not waiting
    before_optimizer()
    t1 = time.perf_counter()
    queued = queue_optimizer_step(policy, optimizer, config.max_grad_norm, [m["loss"]])
    return dict(step=step, t0=t0, plan=plan, plan_s=plan_s, pack_s=sum(packs), micro=m, queued=queued,
                queue_s=queue_s + time.perf_counter() - t1)


def _conclude(trainer: tuple, queued: dict, warmup: int, args, totals: dict, clock: dict) -> None:
    """Wait for a queued step, print its wall time (from the previous step's conclusion, or its own planning if
    later: between barriers, a step's share of the span) and add a timed step's figures to `totals`."""
    from grpo.step import finish_optimizer_step
    from grpo.step_metrics import resolve_metrics

    _, opt_s, _ = finish_optimizer_step(queued["queued"], trainer[2])
    m = resolve_metrics([queued["micro"]])[0]
    now = time.perf_counter()
    wall, clock["end"] = now - max(queued["t0"], clock["end"]), now
    step, plan = queued["step"], queued["plan"]
    kind = "warm-up" if step < warmup else "timed" if step < warmup + args.steps else "profiled"
    print(f"  step {step} ({kind}): {wall:.2f} s", file=sys.stderr, flush=True)
    if kind != "timed":
        return
    for key, value in (("trained", plan.trained_tokens), ("forwarded", m["_forwarded"]),
                       ("raw", sum(len(s) for r in plan.rows for s in r)), ("attended", m["_attended_keys"]),
                       ("head", m["_head_tokens"]), ("fwd", m["perf/fwd_s"]), ("fwd_bwd", m["perf/fwd_bwd_s"]),
                       ("opt", opt_s), ("plan", queued["plan_s"]), ("pack", queued["pack_s"]),
                       ("queue", queued["queue_s"])):
        totals[key] += value


def _case_result(case: dict, totals: dict, build_s: float, model, policy, info, n: int) -> dict:
    """`case` (shape, ratio, mode, overrides, ranks) plus the figures of its `n` timed steps' `totals`; peak memory
    is read first, before the head is timed on its own."""
    import torch

    from grpo.flops import device_peak_flops, mfu, training_flops
    from grpo.step import policy_module

    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if info.device.type == "cuda" else float("nan")
    head = policy_module(policy)
    flops = training_flops(model.config, totals["forwarded"], totals["attended"], totals["head"])
    return {
        **case,
        "packing_ratio": totals["raw"] / max(totals["forwarded"], 1),
        "flops_per_trained": flops / max(totals["trained"], 1) if flops else None,
        "trained_tok_s": totals["trained"] / totals["wall"],
        "forwarded_tok_s": totals["forwarded"] * info.world_size / totals["wall"],
        "mfu": mfu(flops * info.world_size if flops else None, totals["wall"], device_peak_flops(info.device),
                   info.world_size),
        "peak_gib": peak_gib, "build_s": build_s,
        "checkpointed_layers": sum(bool(getattr(l, "gradient_checkpointing", False))
                                   for l in _layers(model)),
        "fwd_ms": 1e3 * totals["fwd"] / n, "bwd_ms": 1e3 * (totals["fwd_bwd"] - totals["fwd"]) / n,
        "head_ms": head_ms(model, totals["head"] // n, head.keep_logits_bytes, head.fused_head),
        "head_variants_ms": {name: head_ms(model, totals["head"] // n, keep, head.fused_head)  # side by side
                             for name, keep in HEAD_VARIANTS.items()} if head.keep_logits_bytes else {},
        "opt_ms": 1e3 * totals["opt"] / n,
        "host_ms": 1e3 * (totals["wall"] - totals["fwd_bwd"] - totals["opt"]) / n,
        **{f"{k}_ms": 1e3 * totals[k] / n for k in ("plan", "pack", "queue")},
    }


_PROFILED: list = []
_WARMED: list = []


def _profiler(enabled: bool):
    """torch.profiler over the timed steps of the first case (--profile): a table of the top kernels."""
    if not enabled:
        return None
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, with_stack=True)


def _layers(model):
    from grpo.distributed import decoder_layers

    return decoder_layers(model)


def run_checks(shape: str, model_dir: Path, info, variants: list[dict]) -> None:
    """`--check`: packed vs per-sample log-probs for each variant's config (its bench switches aside), once each."""
    for fields in {json.dumps({k: v for k, v in o.items() if k not in BENCH_SWITCHES}): o for o in variants}:
        check = check_packed_vs_unpacked(model_dir, info, json.loads(fields))
        if info.is_main:
            print(f"CHECK {shape} {fields} packed vs per-sample log-probs: {json.dumps(check)}", flush=True)


def parse_overrides(items: list[str]) -> dict:
    """key=value pairs for AsyncGRPOConfig; values parsed as JSON where they parse (true, 3, 0.5), else strings."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
        if key == "gradient_checkpointing":
            out[key] = str(value).lower()
    return out


def print_table(results: list[dict]) -> None:
    print(f"{'shape':<12} {'ratio':>5} {'mode':<6} {'set':<28} {'pack':>5} {'trained/s':>10} {'fwd tok/s':>10} "
          f"{'MFU':>6} {'peak GiB':>8} {'ckpt':>4} {'fwd':>7} {'bwd':>7} {'head':>7} {'opt':>6} {'host':>6} "
          f"{'plan':>5} {'pack':>5} {'queue':>5}")
    for r in results:
        mfu_s = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        sets = ",".join(f"{k}={v}" for k, v in r["overrides"].items()) or "defaults"
        print(f"{r['shape']:<12} {r['ratio']:>5} {r['mode']:<6} {sets:<28} {r['packing_ratio']:>5.2f} "
              f"{r['trained_tok_s']:>10.0f} {r['forwarded_tok_s']:>10.0f} {mfu_s:>6} {r['peak_gib']:>8.1f} "
              f"{r['checkpointed_layers']:>4} {r['fwd_ms']:>7.0f} {r['bwd_ms']:>7.0f} {r['head_ms']:>7.0f} "
              f"{r['opt_ms']:>6.0f} {r['host_ms']:>6.0f} {r['plan_ms']:>5.1f} {r['pack_ms']:>5.1f} "
              f"{r['queue_ms']:>5.0f}")
    every = results[0].get("sync_every", 0) if results else 0
    print("steps: " + ("each concluded before the next was planned (--sync-every 1: train.py with weight_sync_steps "
                       "1, without the sync itself)" if every == 1 else
                       "the next one planned, packed and its forward queued while the previous one's backward ran "
                       "(train.py between weight syncs; "
                       + (f"a barrier every {every} steps)" if every else "no barrier but the last step)")))
    by_key = {(r["ratio"], r["mode"], json.dumps(r["overrides"])): r for r in results}
    for (ratio, mode, sets), r in by_key.items():
        plain = by_key.get((ratio, "plain", sets))
        if mode == "tree" and plain:
            ceiling = (f", FLOP ceiling {plain['flops_per_trained'] / r['flops_per_trained']:.2f}x (equal MFU)"
                       if r.get("flops_per_trained") and plain.get("flops_per_trained") else "")
            print(f"tree / plain at ratio {ratio} ({sets}): {r['trained_tok_s'] / plain['trained_tok_s']:.2f}x "
                  f"trained tokens/s{ceiling}")
    for r in (r for r in results if r.get("head_variants_ms")):
        print(f"head at ratio {r['ratio']} {r['mode']}: {r['head_ms']:.1f} ms as the policy runs it; "
              + "; ".join(f"{ms:.1f} ms {name}" for name, ms in r["head_variants_ms"].items()))


def main() -> None:
    import logging

    from grpo.distributed import init_distributed

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="Qwen3-1.7B")
    p.add_argument("--ratio", type=float, nargs="+", default=[1.0, 3.4])
    p.add_argument("--modes", nargs="+", default=["tree", "plain"], choices=["tree", "plain"])
    p.add_argument("--set", nargs="*", default=[], action="append", metavar="KEY=VALUE",
                   help="config overrides for one extra variant (repeat --set for several variants; "
                        "the defaults always run first)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--first-warmup", type=int, default=4,
                   help="extra warm-up steps for the process's first case (on an H200 its steps kept speeding up "
                        "for ~5 steps, later cases' after one: without these the first read 5-20 %% slow)")
    p.add_argument("--sync-every", type=int, default=0, metavar="K",
                   help="conclude every K-th step before planning the next (train.py's barrier: a weight sync with "
                        "weight_sync_steps K, a checkpoint); 1 = every step, 0 (default) = only the last. Between "
                        "barriers the next step's planning, packing and forward are queued while the previous "
                        "step's backward and optimizer run (train.py between weight syncs)")
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--prompt-len", type=int, default=1068, help="tokens per prompt of the synthetic groups")
    p.add_argument("--completion-len", type=int, default=256, help="tokens per completion of the synthetic groups")
    p.add_argument("--model-dir", type=Path, default=Path("/tmp/bench_step_models"))
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--check", action="store_true",
                   help="first compare the fast path's packed log-probs with per-sample forwards (bf16 on GPU), for "
                        "each variant's config")
    p.add_argument("--skip-defaults", action="store_true", help="run only the --set variants")
    p.add_argument("--profile", action="store_true", help="print the top kernels of the first case's timed steps")
    p.add_argument("--trace", type=Path, default=None,
                   help="with --profile: also write the profiled steps' timeline (host and GPU) as a gzipped "
                        "chrome trace (chrome://tracing, ui.perfetto.dev) to this path + .gz")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    info = init_distributed()
    model_dir = write_model(args.shape, args.model_dir) if info.is_main else None
    from grpo.distributed import barrier, broadcast_object

    barrier(info)
    model_dir = Path(broadcast_object(str(model_dir) if model_dir else None, info))
    variants = ([] if args.skip_defaults else [{}]) + [parse_overrides(s) for s in args.set if s]
    if args.check:
        run_checks(args.shape, model_dir, info, variants)
    results = []
    for overrides in variants:
        for ratio in args.ratio:
            for mode in args.modes if ratio > 1.5 or not overrides else ["tree"]:
                r = run_case(model_dir, ratio, mode, overrides, args, info)
                results.append(r)
                if info.is_main:
                    print("RESULT " + json.dumps(r), flush=True)
    if info.is_main:
        print_table(results)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
