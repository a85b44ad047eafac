"""Held-out accuracy of a served model, standalone: greedy (and optionally k sampled) answers to a task's held-out
prompts through a running vLLM server's chat route, scored by a project reward, with a 95 % interval.

The trainer's own evaluation (`--eval-dataset`, grpo/evaluation.py) runs inside the rollout worker during
training; this script measures a checkpoint without a trainer: the step-0 baseline, or a TRL checkpoint in
scripts/bench_vs_trl.py.

    python rollout.py serve --server.cpu --server.model .models/smollm2-135m-instruct ... &   # or any server
    python scripts/eval_heldout.py --base-url http://127.0.0.1:8000 --dataset builtin:word_problems_heldout \\
        --num-prompts 256 --out outputs/baseline.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere: `grpo` is the checkout's


def wilson_interval(successes: int, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95 % by default); stays inside [0, 1] at 0 or n."""
    if trials == 0:
        return float("nan"), float("nan")
    p = successes / trials
    centre = (p + z * z / (2 * trials)) / (1 + z * z / trials)
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / (1 + z * z / trials)
    # at 0 or n successes the edge is exactly 0 or 1; the formula reaches it only up to rounding
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def chat(base_url: str, model: str, messages: list, max_tokens: int, temperature: float, n: int, seed: int) -> list:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature, "n": n,
            "seed": seed}
    request = urllib.request.Request(f"{base_url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return [choice["message"]["content"] or "" for choice in json.load(response)["choices"]]


def evaluate(base_url: str, rows: list, max_tokens: int, k: int, temperature: float, seed: int,
             concurrency: int, reward: str, answers_path: Path | None = None) -> dict:
    from grpo.rewards import resolve_reward

    score = resolve_reward(reward)
    model = served_model(base_url)
    start = time.perf_counter()

    def one(row):
        greedy = chat(base_url, model, row["prompt"], max_tokens, 0.0, 1, seed)
        sampled = chat(base_url, model, row["prompt"], max_tokens, temperature, k, seed) if k else []
        return greedy + sampled

    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, rows))
    seconds = time.perf_counter() - start
    if answers_path:  # before scoring: the generation is the expensive part
        answers_path.write_text("".join(json.dumps({"solution": row.get("solution"), "answers": texts}) + "\n"
                                        for row, texts in zip(rows, answers)))
    columns = {key: [row[key] for row in rows for _ in range(1 + k)] for key in rows[0] if key != "prompt"}
    completions = [[{"role": "assistant", "content": text}] for texts in answers for text in texts]
    rewards = [r if r is not None else 0.0 for r in score(completions=completions, **columns)]
    greedy = [rewards[i * (1 + k)] for i in range(len(rows))]
    correct = int(sum(r >= 1.0 for r in greedy))
    low, high = wilson_interval(correct, len(rows))
    result = {"model": model, "num_prompts": len(rows), "greedy_correct": correct,
              "greedy_accuracy": correct / len(rows), "ci95": [low, high], "max_tokens": max_tokens,
              "generation_seconds": seconds, "examples": [a[0] for a in answers[:3]]}
    if k:
        groups = [rewards[i * (1 + k) + 1:(i + 1) * (1 + k)] for i in range(len(rows))]
        result |= {"k": k, "temperature": temperature, f"pass@{k}": sum(max(g) >= 1.0 for g in groups) / len(rows),
                   f"mean@{k}": sum(sum(g) / k for g in groups) / len(rows)}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="a running vLLM server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--dataset", default="builtin:word_problems_heldout", help="held-out prompts (load_prompts)")
    parser.add_argument("--num-prompts", type=int, default=256, help="first N rows of the held-out split")
    parser.add_argument("--reward", default="accuracy", help="a --reward-funcs name scoring the answers")
    parser.add_argument("--max-tokens", type=int, default=256, help="completion length limit")
    parser.add_argument("--k", type=int, default=0, help="also draw k sampled answers a prompt (pass@k, mean@k)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the k answers")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed sent to the server")
    parser.add_argument("--concurrency", type=int, default=16, help="prompts in flight")
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here too")
    args = parser.parse_args(argv)
    from grpo.data import load_prompts

    rows = list(load_prompts(args.dataset))[:args.num_prompts]
    answers = args.out.with_suffix(".answers.jsonl") if args.out else None
    if answers:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    result = evaluate(args.base_url, rows, args.max_tokens, args.k, args.temperature, args.seed, args.concurrency,
                      args.reward, answers) | {"dataset": args.dataset, "seed": args.seed}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
