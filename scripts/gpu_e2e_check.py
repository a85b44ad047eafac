"""Checks for scripts/gpu_e2e.sh: one training run against a real vLLM server on the same GPU, judged from the
outside (its metrics, its checkpoint, the server's own logprobs). Prints PASS/FAIL per check and an async-vs-sync
table when two runs are given; exits 1 if any check fails. `--report` prints the one-GPU summary of a whole
gpu_e2e.sh output folder (steady state per run, S, the overlap figures, the acceptance targets).

    python scripts/gpu_e2e_check.py --server http://127.0.0.1:8000 --initial /tmp/models/qwen3-0.6b \
        --run outputs/e2e_sync --max-staleness 0 --steps 20 [--compare-with outputs/e2e_async]
    python scripts/gpu_e2e_check.py --report outputs/gpu_e2e --warmup 3
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PROMPT = [151644, 872, 198, 12480, 448, 6364, 4244, 1172, 13, 151645, 198, 151644, 77091, 198]
COMPLETION = [785, 4226, 374, 264, 3460, 1879, 315, 4244, 323, 11931, 13, 151645]


def server_logprobs(url: str, model: str, ids: list[int]) -> torch.Tensor:
    """The server's processed log-prob of every token after the first (prompt_logprobs, T = 1)."""
    import httpx

    body = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}).json()
    entries = body["choices"][0]["prompt_logprobs"][1:]
    return torch.tensor([entries[i][str(t)]["logprob"] for i, t in enumerate(ids[1:])])


def model_logprobs(path, ids: list[int], dtype=torch.float32) -> torch.Tensor:
    """The same quantity from a checkpoint, on the GPU (fp32 unless asked)."""
    from grpo.model import load_policy

    model = load_policy(str(path), "float32").to(device="cuda", dtype=dtype).eval()
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1)
    out = logp[:-1].gather(-1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0].cpu()
    del model
    torch.cuda.empty_cache()
    return out


def tree_check(url: str, model_dir: Path, seed: int = 0) -> tuple[bool, str]:
    """The server's processed log-probs of 4 sequences sharing a 48-token prompt against the trainer's own
    tree-packed forward of the same weights (`build_policy`: FSDP2 bf16, compiled layers, the GDN tree path),
    with the bf16-vs-fp32 gap of an eager per-sample forward as the tolerance floor."""
    import dataclasses
    import random

    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import init_distributed
    from grpo.samples import TrainingSample
    from grpo.trie import pack_samples
    from grpo.policy import build_policy

    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 100_000) for _ in range(48)]
    seqs = [prompt + [rng.randrange(1000, 100_000) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    info = init_distributed()
    config = dataclasses.replace(AsyncGRPOConfig(model=str(model_dir), token_budget=1024))
    _, policy, *_ = build_policy(config, info, 1024)
    samples = [TrainingSample(ids, [0] + [1] * (len(ids) - 1), [-1.0] * len(ids), 1.0, 0, 0) for ids in seqs]
    row = pack_samples(samples).to(info.device)
    with torch.no_grad():
        packed = policy(row).policy_logprobs.float()[torch.argsort(row.sample_id, stable=True)].cpu()
    del policy
    torch.cuda.empty_cache()
    served = torch.cat([server_logprobs(url, str(model_dir), ids) for ids in seqs])
    fp32 = torch.cat([model_logprobs(model_dir, ids) for ids in seqs])
    bf16 = torch.cat([model_logprobs(model_dir, ids, torch.bfloat16) for ids in seqs])
    d, d_fp32, floor = (served - packed).abs(), (served - fp32).abs(), (bf16 - fp32).abs().mean()
    ok = bool(d.mean() <= 2 * floor + 0.01 and torch.isfinite(packed).all())
    return ok, (f"{d.numel()} tokens: |server - trainer packed| mean {d.mean():.4f} max {d.max():.4f}; "
                f"|server - fp32 per-sample| mean {d_fp32.mean():.4f}; bf16 floor {floor:.4f}")


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def total(rows, key) -> float:
    return float(sum(r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])))


def mean(rows, key) -> float:
    values = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
    return sum(values) / len(values) if values else float("nan")


def summary(run: Path) -> dict:
    rows = metrics(run)
    wall = json.loads((run / "wall.json").read_text())["wall_s"] if (run / "wall.json").exists() else float("nan")
    step_s = total(rows, "perf/step_s")
    wait = total(rows, "perf/rollout_wait_s")
    blocked = total(rows, "rollout/backpressure_s")
    trainer_busy = 1 - wait / step_s if step_s else float("nan")
    generator_busy = 1 - blocked / step_s if step_s else float("nan")
    return {"run": run.name, "steps": len(rows), "wall_s": wall, "train_loop_s": step_s, "rollout_wait_s": wait,
            "trainer_busy_frac": trainer_busy, "backpressure_s": blocked, "generator_busy_frac": generator_busy,
            # both sides busy at once, at least (inclusion-exclusion over the train loop)
            "overlap_frac_lb": max(0.0, trainer_busy + generator_busy - 1),
            "gen_tok_s": mean(rows, "rollout/generated_tokens_per_s"),
            "trained_tok_s": mean(rows, "perf/wall_clock_trained_tokens_per_s"),
            "weight_sync_s": mean(rows, "perf/weight_sync_s"),
            "staleness_max": max((r.get("sample/staleness_max") or 0 for r in rows), default=0),
            "reward_first": mean(rows[:5], "reward"), "reward_last": mean(rows[-5:], "reward")}


SYNC_PARTS = ["perf/weight_sync_pause_s", "perf/weight_sync_barrier_s", "perf/weight_sync_start_s",
              "perf/weight_sync_fill_s", "perf/weight_sync_update_s", "perf/weight_sync_finish_s"]


def steady(run: Path, warmup: int) -> dict:
    """Per-step means over the steps after the first `warmup` (compile, first syncs, queue filling), which are
    reported apart."""
    rows = metrics(run)
    rest = rows[warmup:]
    syncs = [r["perf/weight_sync_s"] for r in rest if r.get("perf/weight_sync_s") is not None]
    return {"steps": len(rows), "warmup_step_s": [round(r["perf/step_s"], 3) for r in rows[:warmup]],
            "step_s": mean(rest, "perf/step_s"), "rollout_wait_s": mean(rest, "perf/rollout_wait_s"),
            "train_s": mean(rest, "perf/fwd_bwd_s") + mean(rest, "perf/optimizer_s"),
            "sync_s": sum(syncs) / len(syncs) if syncs else float("nan"), "sync_max_s": max(syncs, default=math.nan),
            "sync_transfer_s": mean(rest, "perf/weight_sync_transfer_s"),
            "sync_parts": {k.removeprefix("perf/weight_sync_").removesuffix("_s"): mean(rest, k) for k in SYNC_PARTS
                           if any(r.get(k) is not None for r in rest)},
            "syncs": 1 + sum(r.get("perf/weight_sync_s") is not None for r in rows)}  # + the cold one


def report(out: Path, warmup: int, sync_target_s: float) -> int:
    """The one-GPU figures of a gpu_e2e.sh output folder: per workload, the async and sync runs' steady state and
    S = sync step / async step, the overlap bench's (<workload>/overlap.json) G, T, G_c, T_c, L, L_c, and the acceptance targets."""
    setup = json.loads((out / "setup.json").read_text()) if (out / "setup.json").exists() else {}
    print(f"\n==== one-GPU report: {out} {json.dumps(setup)}")
    failed, seen = 0, 0
    for workload in sorted(d.name for d in out.iterdir() if d.is_dir() and any(
            (d / x).exists() for x in ("async", "sync", "overlap.json"))):
        print(f"\n-- workload {workload}")
        runs = {name: steady(out / workload / name, warmup) for name in ("async", "sync")
                if (out / workload / name / "metrics.jsonl").exists()}
        seen += len(runs) + (out / workload / "overlap.json").exists()
        for name, r in runs.items():
            print(f"{name:5s}: step {r['step_s']:.3f} s (steady, {r['steps'] - warmup} steps; warm-up "
                  f"{r['warmup_step_s']}), rollout wait {r['rollout_wait_s']:.3f} s, train {r['train_s']:.3f} s, "
                  f"weight sync {r['sync_s']:.3f} s mean / {r['sync_max_s']:.3f} max ({r['syncs']} syncs)")
            if r["sync_parts"]:
                print("       weight sync parts (mean s): " + ", ".join(f"{k} {v:.3f}" for k, v in r["sync_parts"].items()))
            ok = r["sync_s"] <= sync_target_s
            failed += not ok
            transfer = sum(v for k, v in r["sync_parts"].items() if k in ("start", "fill", "update", "finish"))
            print(f"{'PASS' if ok else 'FAIL'} {name}: weight sync {r['sync_s']:.3f} s per sync <= {sync_target_s} s"
                  + (f" (of it the transfer, start to finish: {transfer:.3f} s)" if transfer else ""))
            check = out / workload / f"check_{name}.log"
            line = next((x for x in check.read_text().splitlines() if "server == trainer after the last sync" in x),
                        None) if check.exists() else None
            failed += line is None or not line.startswith("PASS")
            print(f"{line[:4]} {name}: {line[5:]}" if line else f"FAIL {name}: no final-checkpoint logprob check in {check}")
        speedup = runs["sync"]["step_s"] / runs["async"]["step_s"] if len(runs) == 2 else None
        if speedup is not None:
            print(f"S = sync step / async step = {speedup:.2f}")
            if workload == "longtail":  # the workload async training is for
                failed += speedup < 1.5
                print(f"{'PASS' if speedup >= 1.5 else 'FAIL'} longtail: S {speedup:.2f} >= 1.5")
        bench = out / workload / "overlap.json"
        if bench.exists():
            b = json.loads(bench.read_text())
            if speedup is not None:  # how well the pipeline hides waits (S/L_c), what the user gets of the ideal (S/L)
                print(f"S/L = {speedup / b['L']:.2f}, S/L_c = {speedup / b['L_c']:.2f}")
                if workload == "fixed" and setup.get("mps") == "split":
                    failed += speedup / b["L_c"] < 0.9
                    print(f"{'PASS' if speedup / b['L_c'] >= 0.9 else 'FAIL'} fixed, MPS split: S/L_c "
                          f"{speedup / b['L_c']:.2f} >= 0.9")
            print(f"overlap ({b['rollouts_per_step']:.0f} rollouts, {b['completion_tokens_per_step']:.0f} completion "
                  f"tokens per step, {b['in_flight']} steps in flight, top-{b['num_sampler_logprobs']} logprobs): "
                  f"G {b['G']:.3f} s, T {b['T']:.3f} s alone (G/T {b['G'] / b['T']:.2f}); together G_c "
                  f"{b['G_c']:.3f} s, T_c {b['T_c']:.3f} s; L = (G+T)/max(G,T) = {b['L']:.2f}, "
                  f"L_c = (G+T)/max(G_c,T_c) = {b['L_c']:.2f}")
            print("  warm-up reps: " + ", ".join(f"{k} {[round(x, 3) for x in v['warmup_s']]}"
                                                 for k, v in b["phases"].items()))
    if not seen:  # nothing ran (a run that died before its first metric, a wrong folder): not a success
        failed += 1
        print(f"FAIL no run and no overlap bench found under {out}")
    print(f"\nreport: {'all targets met' if not failed else f'{failed} target(s) missed'}")
    return 1 if failed else 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--report", type=Path, default=None, help="print the one-GPU summary of a gpu_e2e.sh output dir")
    p.add_argument("--warmup", type=int, default=3, help="--report: steps per run excluded from the steady state")
    p.add_argument("--sync-target-s", type=float, default=0.15, help="--report: acceptance bound per weight sync")
    p.add_argument("--server")
    p.add_argument("--initial", type=Path)
    p.add_argument("--run", type=Path, default=None)
    p.add_argument("--tree", action="store_true", help="only the server-vs-trainer tree-packed log-prob check "
                   "(run it before training, while the server holds the initial weights)")
    p.add_argument("--compare-with", type=Path, default=None, help="the async run this (synchronous) run is "
                   "compared with")
    p.add_argument("--max-staleness", type=int, default=4)
    p.add_argument("--steps", type=int, default=None, help="the run's --max-steps (required without --tree)")
    args = p.parse_args()
    if args.report is None and (args.server is None or args.initial is None):
        p.error("--server and --initial are required (or --report)")
    if args.report is None and not args.tree and (args.run is None or args.steps is None):
        p.error("--run and --steps are required (or --tree)")
    return args


def check_run(args, check) -> dict:
    """The run's own record: rollouts flowed, the trainer trained, a weight sync per step, staleness within its
    bound, metrics written. Returns the run's `summary`."""
    rows = metrics(args.run)
    s = summary(args.run)
    check("rollouts flow", len(rows) == args.steps and s["gen_tok_s"] > 0,
          f"{len(rows)} logged steps of {args.steps}, generation {s['gen_tok_s']:.0f} tok/s")
    losses = [r["loss"] for r in rows if r.get("loss") is not None]
    check("trainer trains", losses and all(math.isfinite(x) for x in losses) and total(rows, "grad_norm") > 0,
          f"{len(losses)} finite losses, mean grad_norm {mean(rows, 'grad_norm'):.3g}, "
          f"reward {s['reward_first']:.3f} -> {s['reward_last']:.3f}")
    syncs = sum(1 for r in rows if r.get("perf/weight_sync_s") is not None)
    check("a sync every step", syncs == len(rows), f"{syncs} syncs logged over {len(rows)} steps, "
          f"{s['weight_sync_s']:.2f} s each")
    check("staleness within bound", s["staleness_max"] <= args.max_staleness,
          f"sample/staleness_max {s['staleness_max']} <= {args.max_staleness}")
    check("metrics written", (args.run / "metrics.jsonl").exists() and any((args.run / "tensorboard").glob("*")),
          "metrics.jsonl + tensorboard events")
    return s


def check_final_sync(args, check) -> None:
    """The server (holding the last synced weights) against the run's final checkpoint, read from the outside."""
    final = sorted(args.run.glob("checkpoint-*"), key=lambda q: int(q.name.split("-")[1]))[-1]
    ids = PROMPT + COMPLETION
    served = server_logprobs(args.server, str(args.initial), ids)
    trained, initial = model_logprobs(final, ids), model_logprobs(args.initial, ids)
    noise = (model_logprobs(final, ids, torch.bfloat16) - trained).abs().mean()  # bf16 vs fp32, same weights
    d_trained, d_initial = (served - trained).abs(), (served - initial).abs()
    check("server == trainer after the last sync (bf16 tolerance)",
          d_trained.mean() <= 2 * noise + 0.01 and d_trained.mean() < 0.5 * d_initial.mean(),
          f"|server - {final.name}| mean {d_trained.mean():.4f} max {d_trained.max():.4f} (bf16 floor "
          f"{noise:.4f}); |server - initial model| mean {d_initial.mean():.4f}")


def print_comparison(s: dict, c: dict) -> None:
    """The async run's summary `s` next to this synchronous run's `c`."""
    keys = list(s)
    print("\nasync vs sync (same model, steps, data):")
    print(" | ".join(f"{k}" for k in keys))
    for r in (s, c):
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    print(f"wall-time ratio sync/async: {c['wall_s'] / s['wall_s']:.2f}x; "
          f"train-loop ratio: {c['train_loop_s'] / s['train_loop_s']:.2f}x")
    print("SUMMARY " + json.dumps({"async": s, "sync": c}))


def main() -> int:
    args = parse_args()
    if args.report is not None:
        return report(args.report, args.warmup, args.sync_target_s)
    if args.tree:
        ok, detail = tree_check(args.server, args.initial)
        print(f"{'PASS' if ok else 'FAIL'} server == trainer's tree-packed forward (bf16 tolerance): {detail}")
        return 0 if ok else 1
    results: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        results.append((name, bool(ok), detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    s = check_run(args, check)
    check_final_sync(args, check)
    if args.compare_with is not None:
        print_comparison(summary(args.compare_with), s)  # s: this synchronous run
    failed = [n for n, ok, _ in results if not ok]
    print(f"\n{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
