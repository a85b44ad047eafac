"""The split tree attention (grpo/kernels/tree_split.py) of one attention layer on one trainer row, piece by piece and per
kernel: time and error against torch's FlashAttention.

    python scripts/bench_attention.py                          # Qwen3-1.7B heads: tree (ratio 3.4) and plain rows
    python scripts/bench_attention.py --heads 8 2 256          # Qwen3.5-2B's full-attention layers
    python scripts/bench_attention.py --kernels flash cudnn    # torch's cuDNN attention beside FlashAttention
    python scripts/bench_attention.py --kernels flash fa4      # FlashAttention-4 (PyPI flash-attn-4) beside FA2
    python scripts/bench_attention.py --rows tree --part1-by-depth   # part 1 as two calls: roots, then the rest

Rows are scripts/bench_step.py's workload (groups of 8 rollouts, 1068-token prompts, 256-token completions, up to
--token-budget unique tokens; built by scripts/bench_gdn.py's `build_row`), q/k/v random bf16. Pieces: part 1 (each
segment causally over itself) forward and backward, part 2 (each token over its parent's path) forward and
backward with its K/V gather, the merge (compiled `merge_in_place`, the Triton kernel of grpo/kernels/split_merge.py, and
eager), and the whole split forward + backward as autograd runs it. Times are CUDA-event medians; errors are
max |x - flash| / max |flash| over out, dq, dk, dv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def cudnn_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """torch's cuDNN attention, ragged (varlen): (out, lse [H, T_q] fp32, aux) like `tree_split.flash_forward`."""
    import torch

    res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False,
                                                  scale=scale)
    out, lse = res[0], res[1]
    layout = tuple(lse.shape)
    lse = lse.reshape(q.shape[0], q.shape[1]).t().contiguous() if lse.dim() == 3 else lse
    return out, lse, (res[6], res[7], layout)


def cudnn_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux):
    import torch

    seed, offset, layout = aux
    if len(layout) == 3:
        lse = lse.t().contiguous().reshape(layout)
    return torch.ops.aten._cudnn_attention_backward(dout, q, k, v, out, lse, seed, offset, None, cu_q, cu_k, max_q,
                                                    max_k, 0.0, causal, scale=scale)


def fa4_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """FlashAttention-4's varlen forward (CuTe DSL kernels, compiled at first use per shape): (out, lse [H, T_q] fp32,
    None) like `tree_split.flash_forward`. Its internal entry is called because the public one hides the lse from
    autograd's backward, which the split's merge needs."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                                   max_seqlen_k=max_k, softmax_scale=scale, causal=causal, return_lse=True)
    if tuple(lse.shape) == (q.shape[0], q.shape[1]):
        lse = lse.t()
    return out, lse.float().contiguous(), None


def fa4_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale, aux):
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal, cu_seqlens_q=cu_q,
                                 cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k)[:3]
    return dq, dk, dv


def primitives(name: str):
    from grpo.kernels import tree_split

    return {"flash": (tree_split.flash_forward, tree_split.flash_backward),
            "cudnn": (cudnn_forward, cudnn_backward),
            "fa4": (fa4_forward, fa4_backward)}[name]


def first_call_seconds(plan, q, k, v, dout, kernel: str) -> dict:
    """Wall seconds of the first and second part-1 forward + backward with `kernel` (a kernel compiled at run time,
    like FA4's, pays its compile in the first; the second shows whether it was cached)."""
    import time

    import torch

    fwd, bwd = primitives(kernel)
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out, lse, aux = fwd(q, k, v, plan.cu_q, plan.cu_q, plan.max_q, plan.max_q, True, q.shape[-1] ** -0.5)
        bwd(dout, q, k, v, out, lse, plan.cu_q, plan.cu_q, plan.max_q, plan.max_q, True, q.shape[-1] ** -0.5, aux)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {"first call s": times[0], "second call s": times[1]}


def cuda_ms(fn, reps: int) -> float:
    """Median of `reps` CUDA-event timings of fn() after 3 warm-up calls."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def inputs(row, heads: int, kv_heads: int, dim: int, seed: int = 0):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    n = row.num_tokens
    q, dout = (torch.randn(n, heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    k, v = (torch.randn(n, kv_heads, dim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return q, k, v, dout


def compiled_merge(*args):
    """The merge as torch.compile's kernel of its definition (bench_step's `bench_merge_compiled` switch)."""
    from bench_patches import merge_compiled

    from grpo.kernels import tree_split

    with merge_compiled():
        return tree_split._merge_rows(*args)


def pieces(plan, q, k, v, dout, kernel: str, reps: int) -> dict:
    """ms of each piece of one split forward + backward with `kernel`'s primitives."""
    from grpo.kernels import tree_split
    from grpo.kernels.split_merge import merge_rows_triton

    fwd, bwd = primitives(kernel)
    scale = q.shape[-1] ** -0.5
    part1 = lambda: fwd(q, k, v, plan.cu_q, plan.cu_q, plan.max_q, plan.max_q, True, scale)  # noqa: E731
    out, lse, aux = part1()
    times = {"part1 fwd": cuda_ms(part1, reps)}
    times["part1 bwd"] = cuda_ms(lambda: bwd(dout, q, k, v, out, lse, plan.cu_q, plan.cu_q, plan.max_q,
                                             plan.max_q, True, scale, aux), reps)
    if not plan.has_ancestors:
        return times
    gather = lambda: tree_split._part2_inputs(plan, q, k, v)  # noqa: E731
    qb, kb, vb = gather()
    times["part2 gather"] = cuda_ms(gather, reps)
    part2 = lambda: fwd(qb, kb, vb, plan.anc_cu_q, plan.anc_cu_k, plan.anc_max_q, plan.anc_max_k, False,  # noqa
                        scale)
    out_b, lse_b, aux_b = part2()
    times["part2 fwd"] = cuda_ms(part2, reps)
    if plan.in_place:
        merges = {"merge compiled": lambda: compiled_merge(out, lse, out_b, lse_b, plan.anc_q_index),
                  "merge triton": lambda: merge_rows_triton(out, lse, out_b, lse_b, plan.anc_q_index),
                  "merge eager": lambda: tree_split.merge_in_place(out, lse, out_b, lse_b, plan.anc_q_index)}
        for name, fn in merges.items():
            times[name] = cuda_ms(fn, reps)
        out_m, lse_m = tree_split._merge_rows(out, lse, out_b, lse_b, plan.anc_q_index)
        times["part2 bwd"] = cuda_ms(lambda: bwd(dout, q, kb, vb, out_m, lse_m, plan.anc_cu_q, plan.anc_cu_k,
                                                 plan.anc_max_q, plan.anc_max_k, False, scale, aux_b), reps)
    return times


def part1_by_depth(row, q, k, v, dout, kernel: str, reps: int) -> dict:
    """Part 1 as two calls on level-major copies (roots, then every other segment; --part1-by-depth): the grid of
    each sized by its own longest segment. ms of the copy (q, k, v, dout) and of each call, and the error of the
    result against part 1 on the row."""
    import torch

    fwd, bwd = primitives(kernel)
    scale = q.shape[-1] ** -0.5
    cu, parent = row.cu_seqlens_q.long().cpu(), row.seg_parent.cpu()
    lens = (cu[1:] - cu[:-1]).tolist()
    times, parts = {}, []
    for name, segs in (("roots", (parent < 0).nonzero().flatten().tolist()),
                       ("others", (parent >= 0).nonzero().flatten().tolist())):
        idx = torch.cat([torch.arange(int(cu[s]), int(cu[s + 1])) for s in segs]).to(q.device)
        seg_cu = torch.tensor([0, *torch.tensor([lens[s] for s in segs]).cumsum(0).tolist()], dtype=torch.int32,
                              device=q.device)
        top = max(lens[s] for s in segs)
        take = lambda: [t.index_select(0, idx) for t in (q, k, v, dout)]  # noqa: E731, B023
        qs, ks, vs, ds = take()
        times[f"part1 {name} copy"] = cuda_ms(take, reps)
        call = lambda: fwd(qs, ks, vs, seg_cu, seg_cu, top, top, True, scale)  # noqa: E731, B023
        out, lse, aux = call()
        times[f"part1 {name} fwd"] = cuda_ms(call, reps)
        times[f"part1 {name} bwd"] = cuda_ms(lambda: bwd(ds, qs, ks, vs, out, lse, seg_cu, seg_cu, top, top,  # noqa
                                                         True, scale, aux), reps)
        parts.append((idx, out))
    want, _, _ = fwd(q, k, v, row.cu_seqlens_q, row.cu_seqlens_q, row.max_seqlen_q, row.max_seqlen_q, True, scale)
    got = torch.empty_like(want)
    for idx, out in parts:
        got[idx] = out
    times["part1 by depth err"] = error(got, want)
    return times


def whole_paths(row, q, k, v, dout, kernel: str, reps: int) -> dict:
    """Formulation 1 (`flash_varlen`'s maths, --part1-by-depth): one causal call of every segment over its whole
    root-to-segment path (K/V gathered per segment, bottom-right aligned), backward with the scatter-add of dK/dV.
    ms of the gather, the call each way and the scatter-add, and the error against the split."""
    import torch

    fwd, bwd = primitives(kernel)
    scale = q.shape[-1] ** -0.5
    index = row.kv_index
    gather = lambda: (k.index_select(0, index), v.index_select(0, index))  # noqa: E731
    kp, vp = gather()
    call = lambda: fwd(q, kp, vp, row.cu_seqlens_q, row.cu_seqlens_k, row.max_seqlen_q, row.max_seqlen_k,  # noqa
                       True, scale)
    out, lse, aux = call()
    times = {"paths gather": cuda_ms(gather, reps), "paths fwd": cuda_ms(call, reps)}
    back = lambda: bwd(dout, q, kp, vp, out, lse, row.cu_seqlens_q, row.cu_seqlens_k, row.max_seqlen_q,  # noqa
                       row.max_seqlen_k, True, scale, aux)
    times["paths bwd"] = cuda_ms(back, reps)
    _, dkp, dvp = back()

    def scatter():
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device).index_add_(0, index, dkp.float())
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device).index_add_(0, index, dvp.float())
        return dk.to(k.dtype), dv.to(v.dtype)

    times["paths scatter-add"] = cuda_ms(scatter, reps)
    from grpo.kernels.tree_split import SplitAttention, SplitPlan

    want = SplitAttention.apply(q, k, v, SplitPlan.of(row, flash=q.is_cuda), scale)
    times["paths err"] = error(out, want)
    return times


def whole(plan, q, k, v, dout, kernel: str, reps: int):
    """(ms, (out, dq, dk, dv)) of the split forward + backward through autograd with `kernel`'s primitives."""
    import torch

    from grpo.kernels import tree_split

    saved = tree_split.SplitPlan.ops
    tree_split.SplitPlan.ops = lambda self: primitives(kernel)
    try:
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]

        def step():
            for t in leaves:
                t.grad = None
            out = tree_split.SplitAttention.apply(*leaves, plan, q.shape[-1] ** -0.5)
            out.backward(dout)
            return out

        ms = cuda_ms(step, reps)
        out = step()
        torch.cuda.synchronize()
        return ms, (out.detach(), *(t.grad for t in leaves))
    finally:
        tree_split.SplitPlan.ops = saved


def error(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-12))


def bench(kind: str, row, args) -> list[dict]:
    from grpo.kernels.tree_split import SplitPlan

    row = row.to("cuda")
    plan = SplitPlan.of(row, flash=True)
    q, k, v, dout = inputs(row, *args.heads)
    results, reference = [], None
    for kernel in args.kernels:
        res = {"row": kind, "kernel": kernel, "tokens": row.num_tokens, "in_place": plan.in_place}
        try:
            res.update(first_call_seconds(plan, q, k, v, dout, kernel))
            res.update(pieces(plan, q, k, v, dout, kernel, args.reps))
            if args.part1_by_depth and plan.has_ancestors:
                res.update(part1_by_depth(row, q, k, v, dout, kernel, args.reps))
                res.update(whole_paths(row, q, k, v, dout, kernel, args.reps))
            res["split fwd+bwd"], got = whole(plan, q, k, v, dout, kernel, args.reps)
            reference = reference or got
            res.update({f"err {n}": error(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, reference)})
            res["nonfinite"] = sum(int((~t.isfinite()).sum()) for t in got)
        except Exception as exc:  # noqa: BLE001 - a kernel this torch/GPU lacks is a row saying so, not a crash
            res["failed"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        print(json.dumps(res), flush=True)
        results.append(res)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, nargs=3, default=[16, 8, 128], metavar=("H", "HKV", "D"))
    p.add_argument("--kernels", nargs="+", default=["flash"], choices=["flash", "cudnn", "fa4"])
    p.add_argument("--rows", nargs="+", default=["tree", "plain"], choices=["tree", "plain"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--part1-by-depth", action="store_true",
                   help="also part 1 as two calls by trie depth, and formulation 1 (whole paths)")
    p.add_argument("--token-budget", type=int, default=16384)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=1068)
    p.add_argument("--completion-len", type=int, default=256)
    args = p.parse_args()
    import torch

    from bench_gdn import build_row

    if not torch.cuda.is_available():
        raise SystemExit("bench_attention times CUDA kernels: run it on a GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"heads {args.heads}", flush=True)
    results = [r for kind in args.rows for r in bench(kind, build_row(args, kind == "tree"), args)]
    for key in dict.fromkeys(k for r in results for k in r if k not in ("row", "kernel", "tokens", "in_place")):
        cells = "  ".join(f"{r['row']}/{r['kernel']}: {r[key]:.4g}" if isinstance(r.get(key), float)
                          else f"{r['row']}/{r['kernel']}: {r.get(key, '-')}" for r in results)
        print(f"{key:>16}  {cells}")


if __name__ == "__main__":
    main()
