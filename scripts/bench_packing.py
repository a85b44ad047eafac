"""Tree packing vs plain padding-free packing: trained tokens/s, fwd+bwd MFU and peak memory, side by side.

    python scripts/bench_packing.py                       # GPU table (Qwen3-0.6B and 1.7B shapes) + CPU packing
    python scripts/bench_packing.py --cpu-only            # only the CPU packing and batching, lists vs arrays

Random-weight bf16 models built from Qwen3Config (no download). Workloads: groups of `group_size` rollouts
sharing a prompt, sized so the trie packing ratio is ~3.4 (prompt ~4.2x the completion), and the same token
counts with nothing shared (ratio ~1). Rows are filled greedily up to `token_budget` unique tokens (tree) or raw
tokens (plain); every mode trains the same samples, so trained tokens/s is the comparable number. Gradient
checkpointing is on (the spec's default). MFU here keeps TRL's older formula (full, not causal,
attention over L = token-weighted mean forwarded tokens per sample), training = 3 x forward, peak 989e12 (H200).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo.samples import TrainingSample  # noqa: E402
from grpo.trie import pack_samples  # noqa: E402

SHAPES = {  # public Qwen3 configs
    "Qwen3-0.6B": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "Qwen3-1.7B": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
}
VOCAB = 151_936
PEAK = 989e12


def make_groups(n_groups, group_size, prompt_len, completion_len, shared, seed=0):
    rng = random.Random(seed)
    groups = []
    for g in range(n_groups):
        prompt = [rng.randrange(100, VOCAB) for _ in range(prompt_len)]
        group = []
        for _ in range(group_size):
            p = prompt if shared else [rng.randrange(100, VOCAB) for _ in range(prompt_len)]
            comp = [rng.randrange(100, VOCAB) for _ in range(completion_len)]
            ids = p + comp
            group.append(TrainingSample(ids, [0] * prompt_len + [1] * completion_len, [-1.0] * len(ids),
                                        rng.uniform(-1, 1), g, 0))
        groups.append(group)
    return groups


def fill_rows(groups, budget, share):
    """Greedy: add whole samples in order while the row's forwarded tokens stay within budget."""
    rows, current = [], []
    for sample in (s for g in groups for s in g):
        trial = current + [sample]
        if current and pack_samples(trial, share_prefixes=share).num_tokens > budget:
            rows.append(current)
            trial = [sample]
        current = trial
    return rows + [current]


def flops_per_token(cfg, seq_len):
    h, nh, nkv, d, inter = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                            cfg.intermediate_size)
    attn = 2 * h * (nh * d + 2 * nkv * d) + 2 * nh * d * h + 4 * nh * d * seq_len
    return cfg.num_hidden_layers * (attn + 6 * h * inter) + 2 * cfg.vocab_size * h


def chunked_loss(hidden, weight, row, chunk=4096):
    from torch.utils.checkpoint import checkpoint

    def piece(h, targets, adv):
        logp = torch.log_softmax((h @ weight.T).float(), -1).gather(-1, targets[:, None])[:, 0]
        return -(logp * adv).sum()

    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, row.num_loss_terms, chunk):
        sl = slice(start, start + chunk)
        total = total + checkpoint(piece, hidden[row.token_index[sl]], row.targets[sl], row.advantages[sl],
                                   use_reentrant=False)
    return total / max(row.num_loss_terms, 1)


def run_mode(model, rows, backend, share):
    from grpo.tree_attention import forward_hidden, lm_head_weight

    packed = [pack_samples(r, share_prefixes=share).to("cuda") for r in rows]

    def step(row):
        hidden = forward_hidden(model, row, backend)
        chunked_loss(hidden, lm_head_weight(model), row).backward()

    step(packed[0])  # warm-up (compiles FlexAttention)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for row in packed:
        step(row)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    forwarded = sum(r.num_tokens for r in packed)
    seq_len = sum(r.num_tokens ** 2 / r.num_samples for r in packed) / forwarded
    return {"s": elapsed, "rows": len(packed), "forwarded": forwarded, "trained": sum(r.num_loss_terms for r in packed),
            "ratio": sum(r.num_raw_tokens for r in packed) / forwarded, "seq_len": seq_len,
            "peak_gb": torch.cuda.max_memory_allocated() / 2**30}


def gpu_table(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    print(f"# {time.strftime('%Y-%m-%d %H:%M')} | {torch.cuda.get_device_name()} | torch {torch.__version__} | "
          f"budget {args.token_budget} | cmd: python {' '.join(sys.argv)}")
    workloads = {}
    for workload, shared in (("3.4", True), ("1", False)):
        groups = make_groups(args.groups, args.group_size, args.prompt_len, args.completion_len, shared)
        workloads[workload] = {share: fill_rows(groups, args.token_budget, share) for share in (False, True)}
    header = (f"{'model':<11} {'ratio~':>6} {'mode':<18} {'rows':>4} {'ratio':>5} {'fwd tok':>8} {'train tok/s':>11} "
              f"{'speedup':>7} {'fwd+bwd MFU':>11} {'peak GB':>7}")
    print(header)
    for name in args.models:
        cfg = Qwen3Config(vocab_size=VOCAB, max_position_embeddings=40960, **SHAPES[name])
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
        model.gradient_checkpointing_enable()
        model.train()
        for workload, rows_by_share in workloads.items():
            modes = [(m, m.split("/")[1], m.startswith("tree")) for m in args.modes]
            base = None
            for label, backend, share in modes:
                try:
                    res = run_mode(model, rows_by_share[share], backend, share)
                except Exception as exc:  # noqa: BLE001 - report the failure in the table and go on
                    print(f"{name:<11} {workload:>6} {label:<18} FAILED: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                tps = res["trained"] / res["s"]
                base = base or tps
                mfu = 3 * flops_per_token(cfg, res["seq_len"]) * res["forwarded"] / res["s"] / PEAK
                print(f"{name:<11} {workload:>6} {label:<18} {res['rows']:>4} {res['ratio']:>5.2f} "
                      f"{res['forwarded']:>8} {tps:>11.0f} {tps / base:>7.2f} {mfu:>11.1%} {res['peak_gb']:>7.1f}",
                      flush=True)
        del model
        torch.cuda.empty_cache()


def cpu_pack_throughput(args):
    """pack_samples per row, and the batcher closing the rows, for samples as lists and as the rollout worker
    publishes them (numpy arrays attached, then pickled across: `TrainingSample.with_arrays`), side by side."""
    import pickle

    from grpo.batcher import TokenBudgetBatcher

    for label, shared in (("ratio~3.4", True), ("ratio~1", False)):
        groups = make_groups(64, args.group_size, args.prompt_len, args.completion_len, shared, seed=1)
        for form in ("lists", "as published"):
            samples = [s for g in groups[:8] for s in g]
            if form == "as published":
                samples = [pickle.loads(pickle.dumps(s.with_arrays())) for s in samples]
            rows = fill_rows([samples], args.token_budget, True)
            raw = sum(len(s) for r in rows for s in r)
            reps = 5
            start = time.perf_counter()
            for _ in range(reps):
                batcher = TokenBudgetBatcher(args.token_budget, 1)
                for sample in samples:
                    batcher.add(sample)
            plan_s = (time.perf_counter() - start) / reps
            start = time.perf_counter()
            for _ in range(reps):
                for r in rows:
                    pack_samples(r)
            elapsed = (time.perf_counter() - start) / reps
            print(f"cpu {label}, samples {form}: pack_samples {raw / elapsed / 1e6:.2f} M raw tokens/s "
                  f"({len(rows)} rows of {raw / len(rows):.0f} raw tokens, {elapsed / len(rows) * 1e3:.1f} ms/row); "
                  f"batcher {plan_s / len(rows) * 1e3:.1f} ms/row")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=1068)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--modes", nargs="+", default=["plain/flash_varlen", "tree/flash_varlen"],
                        choices=["plain/flash_varlen", "tree/flash_varlen", "plain/flex", "tree/flex"],
                        help="flex is opt-in: on an H200 (torch 2.11) its first tree row (~12k tokens, 28 layers) "
                             "did not finish within 5 minutes (compile included)")
    parser.add_argument("--cpu-only", action="store_true")
    args = parser.parse_args()
    cpu_pack_throughput(args)
    if not args.cpu_only:
        gpu_table(args)


if __name__ == "__main__":
    main()
