"""How much one GPU gains from overlapping generation and training: G and T each alone, then both at once.

    python scripts/gpu_overlap.py --server http://127.0.0.1:8000 --model /tmp/models/qwen3-0.6b \
        --workload longtail --max-len 384 --json outputs/overlap_longtail.json

One "step" is what train.py trains per optimizer step: the rollouts that fill `--grad-accum` micro-batches of
`--token-budget` tokens (the real `TokenBudgetBatcher` closes them), groups of `--generations` rollouts sharing a
`--prompt-len`-token prompt. G = seconds of generation per step: `--in-flight` steps' rollouts are requested at
once (the async worker keeps max_staleness steps in flight; `ignore_eos`, so every completion has exactly its
planned length) and the wall time is divided by that count. T = `train_micro_batch` per micro-batch +
`optimizer_step` on the same samples (grpo/step.py; `build_policy`, grpo/policy.py: the run's model, precision,
compile and checkpointing). Phases, one process:
G alone, T alone, then both loops at once (G_c, T_c: only repetitions that finished while the other loop was
still running count). The first `--warmup` repetitions of every phase are reported apart (compile, CUDA graphs of
new batch sizes). L = (G + T) / max(G, T) is what perfect overlap could gain; L_c = (G + T) / max(G_c, T_c) what
this GPU delivers (> 1: overlapping pays even though the two share the GPU).

Workloads (`completion_lengths`): `fixed` = every completion `--max-len` tokens (gen ~ train per token);
`longtail` = 10 % of completions run to `--max-len`, the rest ~Exp(mean max_len / 16) (a step waits for its
longest rollout: the case async training is for). `LongTailLoop` puts the same lengths into train.py's rollouts
(`--loop-cls gpu_overlap:LongTailLoop`, with scripts/ on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import multiprocessing
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from grpo.rollout_loop import AsyncRolloutLoop  # noqa: E402 (light: no torch kernels, no vLLM)

LONG_TAIL_FRACTION = 0.10


def completion_length(workload: str, max_len: int, rng: random.Random) -> int:
    if workload == "fixed":
        return max_len
    if workload == "longtail":
        if rng.random() < LONG_TAIL_FRACTION:
            return max_len
        return min(max_len, 1 + int(rng.expovariate(16.0 / max_len)))
    raise ValueError(f"unknown workload {workload!r} (fixed, longtail)")


class LongTailLoop(AsyncRolloutLoop):
    """train.py's rollouts with long-tail completion lengths: each request's max_tokens is drawn per rollout (a
    random-weight model practically never samples EOS, so the drawn length is the length)."""

    async def generate_one_turn(self, prompt_ids):
        cfg = self.config
        rng = self.__dict__.setdefault("_length_rng", random.Random())
        turn = await self.client.generate(
            prompt_ids, max_tokens=completion_length("longtail", cfg.max_completion_length, rng),
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
            repetition_penalty=cfg.repetition_penalty, num_logprobs=cfg.num_sampler_logprobs,
            use_generate_endpoint=cfg.uses_truncated_sampling)
        self._generated_tokens += len(turn.output_ids)
        return turn


def sample_stream(workload: str, max_len: int, prompt_len: int, generations: int, vocab: int, top_k: int,
                  seed: int = 0):
    """Endless TrainingSamples as the rollout worker delivers them, completion lengths by workload."""
    import numpy as np

    from grpo.samples import TrainingSample

    rng, np_rng, group_id = random.Random(seed), np.random.default_rng(seed), 0
    while True:
        prompt = [rng.randrange(1000, vocab) for _ in range(prompt_len)]
        for _ in range(generations):
            n = completion_length(workload, max_len, rng)
            ids = prompt + [rng.randrange(1000, vocab) for _ in range(n)]
            top_ids = top_logp = None
            if top_k:
                top_ids = np.full((len(ids), top_k), -1, dtype=np.int64)
                top_ids[prompt_len:] = np_rng.integers(1000, vocab, (n, top_k))
                top_logp = np.full((len(ids), top_k), -np.inf, dtype=np.float32)
                top_logp[prompt_len:] = np.sort(np_rng.uniform(-8, -0.1, (n, top_k)))[:, ::-1]
            yield TrainingSample(ids, [0] * prompt_len + [1] * n, [-1.0] * len(ids), rng.uniform(-1, 1), group_id, 0,
                                 sampler_top_ids=top_ids, sampler_top_logprobs=top_logp)
        group_id += 1


def generate_step(url: str, model: str, requests: list[tuple[list[int], int]], top_k: int) -> float:
    """All of a step's requests at once; seconds until the last one finished."""
    import httpx

    async def run() -> float:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
            async def one(prompt, n):
                body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 1.0, "ignore_eos": True,
                        "logprobs": top_k, "return_token_ids": True, "return_tokens_as_token_ids": True,
                        "seed": random.getrandbits(63)}
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()
                got = len(response.json()["choices"][0]["token_ids"])
                if got != n:
                    raise RuntimeError(f"asked for {n} tokens with ignore_eos, got {got}")

            t0 = time.perf_counter()
            await asyncio.gather(*(one(p, n) for p, n in requests))
            return time.perf_counter() - t0

    return asyncio.run(run())


def _gen_worker(url: str, model: str, reps: list, k: int, top_k: int, stop, results) -> None:
    """The concurrent phase's generation loop, in its own process: `reps` (each `k` steps' requests) in turn,
    each put as (seconds per step, wall-clock end), until `stop`."""
    i = 0
    while not stop.is_set():
        results.put((generate_step(url, model, reps[i % len(reps)], top_k) / k, time.time()))
        i += 1


def split(times: list[float], warmup: int) -> dict:
    steady = times[warmup:]
    return {"warmup_s": times[:warmup], "steady_s": statistics.mean(steady) if steady else float("nan"),
            "steady_n": len(steady), "all_s": times}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True)
    p.add_argument("--model", required=True, help="the model directory the server serves (also the trainer's)")
    p.add_argument("--workload", choices=["fixed", "longtail"], default="fixed")
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--prompt-len", type=int, default=48)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--token-budget", type=int, default=None, help="per micro-batch; default the server's max_model_len")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (--gradient-accumulation-steps)")
    p.add_argument("--in-flight", type=int, default=4, help="steps of rollouts requested at once (max_staleness)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per phase (after the warm-up ones)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def step_requests(step: list, prompt_len: int) -> list[tuple[list[int], int]]:
    """A step's rollouts (its micro-batch plans' samples, the batcher's dummy padding left out) as (prompt ids,
    completion length) requests."""
    return [(s.input_ids[:prompt_len], len(s) - prompt_len)
            for plan in step for s in plan.rows[0] if s.group_id >= 0]


def planned_steps(args, budget: int, vocab: int, top_k: int, count: int) -> list[list]:
    """`count` training steps, each `--grad-accum` micro-batch plans closed by the real batcher (seed 0)."""
    from bench_step import next_plan
    from grpo.batcher import TokenBudgetBatcher

    source = sample_stream(args.workload, args.max_len, args.prompt_len, args.generations, vocab, top_k)
    batcher = TokenBudgetBatcher(budget, 1)
    return [[next_plan(batcher, source) for _ in range(args.grad_accum)] for _ in range(count)]


def fresh_requests(args, budget: int, vocab: int, top_k: int) -> Callable[[], list]:
    """Generation's own workload (seed 1): each call returns `--in-flight` fresh steps' requests (no prompt in the
    prefix cache yet)."""
    from bench_step import next_plan
    from grpo.batcher import TokenBudgetBatcher

    source = sample_stream(args.workload, args.max_len, args.prompt_len, args.generations, vocab, top_k, seed=1)
    batcher = TokenBudgetBatcher(budget, 1)

    def gen_requests() -> list:
        return [r for _ in range(args.in_flight * args.grad_accum)
                for r in step_requests([next_plan(batcher, source)], args.prompt_len)]

    return gen_requests


def make_train_step(config, policy, optimizer, scheduler, autocast) -> Callable[[list], float]:
    """train.py's step on a step's plans: `train_micro_batch` per plan, then `optimizer_step`; returns its seconds
    (device synchronised before and after)."""
    import torch

    from grpo.losses import loss_function
    from grpo.step import optimizer_step, train_micro_batch
    from grpo.step_metrics import resolve_metrics

    loss_fn = loss_function(config.loss)

    def device_sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def train_step(step) -> float:
        device_sync()
        t0 = time.perf_counter()
        micro = [train_micro_batch(policy, plan.rows[0], plan, loss_fn, config.loss, 1, len(step), autocast,
                                   config.max_completion_length) for plan in step]
        optimizer_step(policy, optimizer, scheduler, config.max_grad_norm)
        resolve_metrics(micro)
        device_sync()
        return time.perf_counter() - t0

    return train_step


def concurrent_times(args, gen_reps: list, top_k: int, train_step, steps: list,
                     n: int) -> tuple[list[float], list[float]]:
    """Both loops at once until each has `n` repetitions: generation from its own process, as train.py's rollout
    worker (its HTTP and JSON work must not share this process's GIL with the trainer's kernel launches), over
    `gen_reps`; training here, over `steps`. Returns the seconds per step of the repetitions (generation,
    training) that finished while the other loop was still running."""
    done = {"gen": [], "train": []}  # (seconds, wall-clock end) per repetition while both loops run
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    worker = context.Process(target=_gen_worker, daemon=True, args=(
        args.server, args.model, gen_reps, args.in_flight, top_k, stop, results))
    worker.start()
    first = results.get(timeout=600)  # the worker is up and has finished its first repetition
    done["gen"].append(first)
    i = 0
    while len(done["train"]) < n or len(done["gen"]) < n:
        seconds = train_step(steps[i % len(steps)])
        done["train"].append((seconds, time.time()))
        while not results.empty():
            done["gen"].append(results.get())
        i += 1
    stop.set()
    worker.join(600)
    while not results.empty():
        done["gen"].append(results.get())
    both_until = min(done["gen"][-1][1], done["train"][-1][1])
    return ([s for s, end in done["gen"] if end <= both_until],
            [s for s, end in done["train"] if end <= both_until])


def overlap_result(args, budget: int, top_k: int, steps: list, times: dict[str, list[float]]) -> dict:
    """The JSON result: the workload, per-step sizes of the timed `steps`, G, T, G_c, T_c, L, L_c and every phase's
    repetitions (`times`: gen_alone, train_alone, gen_concurrent, train_concurrent)."""
    phases = {name: split(seconds, args.warmup) for name, seconds in times.items()}
    G, T, Gc, Tc = (phases[name]["steady_s"] for name in
                    ("gen_alone", "train_alone", "gen_concurrent", "train_concurrent"))
    step_tokens = [sum(m for _, m in step_requests(step, args.prompt_len)) for step in steps]
    return {"workload": args.workload, "max_len": args.max_len, "token_budget": budget,
            "grad_accum": args.grad_accum, "in_flight": args.in_flight,
            "rollouts_per_step": statistics.mean(len(step_requests(step, args.prompt_len)) for step in steps),
            "completion_tokens_per_step": statistics.mean(step_tokens), "num_sampler_logprobs": top_k,
            "G": G, "T": T, "G_c": Gc, "T_c": Tc, "L": (G + T) / max(G, T), "L_c": (G + T) / max(Gc, Tc),
            "phases": phases}


def print_result(result: dict) -> None:
    g, t, gc_, tc = (result["phases"][name] for name in
                     ("gen_alone", "train_alone", "gen_concurrent", "train_concurrent"))
    print(f"OVERLAP {result['workload']}: G {result['G']:.3f} s, T {result['T']:.3f} s alone; G_c "
          f"{result['G_c']:.3f} s, T_c {result['T_c']:.3f} s together "
          f"({gc_['steady_n']} / {tc['steady_n']} steady reps); L {result['L']:.2f}, L_c {result['L_c']:.2f}; "
          f"warm-up G {['%.2f' % x for x in g['warmup_s']]} T {['%.2f' % x for x in t['warmup_s']]}")
    print("RESULT " + json.dumps(result))


def main() -> None:
    args = parse_args()

    import dataclasses

    import httpx

    from grpo.config import AsyncGRPOConfig
    from grpo.distributed import init_distributed
    from grpo.policy import build_policy

    budget = args.token_budget or int(httpx.get(f"{args.server}/v1/models", timeout=30).json()["data"][0][
        "max_model_len"])
    config = dataclasses.replace(AsyncGRPOConfig(model=args.model, token_budget=budget),
                                 max_completion_length=args.max_len, num_generations=args.generations)
    info = init_distributed()
    model, policy, optimizer, scheduler, autocast = build_policy(config, info, budget)
    top_k = config.num_sampler_logprobs
    vocab = model.config.get_text_config().vocab_size
    n, k = args.warmup + args.reps, args.in_flight
    steps = planned_steps(args, budget, vocab, top_k, 3 * n + 4)
    gen_requests = fresh_requests(args, budget, vocab, top_k)
    train_step = make_train_step(config, policy, optimizer, scheduler, autocast)

    gen_alone = [generate_step(args.server, args.model, gen_requests(), top_k) / k for _ in range(n)]
    train_alone = [train_step(steps[i]) for i in range(n)]
    gen_c, train_c = concurrent_times(args, [gen_requests() for _ in range(3 * n)], top_k, train_step, steps, n)
    result = overlap_result(args, budget, top_k, steps[:n], {
        "gen_alone": gen_alone, "train_alone": train_alone, "gen_concurrent": gen_c, "train_concurrent": train_c})
    print_result(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
