"""Run by tests/test_gdn_dqkwg.py in a subprocess: FLA's Triton `chunk_bwd_dqkwg` kernel, executed by Triton's
interpreter on CPU (TRITON_INTERPRET=1 is set before triton imports), against grpo/kernels/gdn_dqkwg.py's torch version on
the same random inputs. Prints one JSON line: per case, per output, the largest error as a fraction of the
output's largest magnitude.

Then the whole of FLA's gated delta-rule forward + backward, with the torch step in place of FLA's
(`install_torch_dqkwg`), goes through grpo/kernels/gdn_choice.py's `_check_backward` in fp32 (its error against the torch
kernel), and once more with a step whose dk is 1.5x too large (which the check must refuse). Last, FLA's own step
where its guard refuses it, and past that guard (`unguarded_fla_dqkwg`).

argv: repo, the folder holding `fla` (fla-core installed with --target). The interpreter cannot time kernels, so
FLA's autotuned kernels run their first configuration. Its bf16 arithmetic is not Hopper's, so the bf16 cases
hand FLA the fp32 values of the same bf16 inputs (the torch version rounds where the kernel does; the two then
differ by that rounding alone). The interpreter set-up (and its fix to FLA's state kernels) is tests/fla_interpret.py.
"""

import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fla_interpret import interpret_fla  # noqa: E402

copy = interpret_fla(*sys.argv[1:3])

import torch  # noqa: E402
import triton.runtime.autotuner as autotuner  # noqa: E402

from fla.ops.common.chunk_o import chunk_bwd_dqkwg as fla_dqkwg  # noqa: E402

from grpo.kernels.gdn_dqkwg import chunk_bwd_dqkwg  # noqa: E402


def case(seed, batch, length, heads, v_heads, d_k, d_v, lens=None, dtype=torch.float32, state_v_first=False):
    gen = torch.Generator().manual_seed(seed)
    cu = None
    if lens is not None:
        batch, length = 1, sum(lens)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.long)
        chunks = sum(-(-n // 64) for n in lens)
    else:
        chunks = batch * -(-length // 64)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    q, k = rand(batch, length, heads, d_k), rand(batch, length, heads, d_k)
    v, do, dv = (rand(batch, length, v_heads, d_v) for _ in range(3))
    w = rand(batch, length, v_heads, d_k)
    g = -(torch.rand(batch, length, v_heads, generator=gen) * 0.3)  # fp32, as FLA keeps its gates
    state = (v_heads, d_v, d_k) if state_v_first else (v_heads, d_k, d_v)
    lead = (batch, chunks // batch) if lens is None else (1, chunks)
    h, dh = rand(*lead, *state), rand(*lead, *state)
    kwargs = dict(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, dv=dv, scale=d_k ** -0.5, cu_seqlens=cu,
                  state_v_first=state_v_first)
    ours = chunk_bwd_dqkwg(**kwargs)
    as_fp32 = {name: t.float() if torch.is_tensor(t) and t.is_floating_point() else t for name, t in kwargs.items()}
    theirs = fla_dqkwg(**as_fp32)
    return {name: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
            for name, a, b in zip(("dq", "dk", "dw", "dg"), ours, theirs)}


def whole_backward():
    """(error of FLA's backward with the torch step, the check's verdict on a broken step), fp32 inputs."""
    import fla.ops.gated_delta_rule.chunk as fla_chunk
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    import grpo.kernels.gdn_choice as gdn_choice

    make_inputs = gdn_choice._probe_inputs
    gdn_choice._probe_inputs = lambda device, grad, *heads: [t.detach().float().requires_grad_(grad)
                                                             for t in make_inputs(device, grad, *heads)]
    assert gdn_choice.install_torch_dqkwg() and fla_chunk.chunk_bwd_dqkwg is chunk_bwd_dqkwg
    error = gdn_choice._check_backward(chunk_gated_delta_rule, torch.device("cpu"))

    def broken(**kwargs):
        dq, dk, dw, dg = chunk_bwd_dqkwg(**kwargs)
        return dq, dk * 1.5, dw, dg

    fla_chunk.chunk_bwd_dqkwg = broken
    try:
        gdn_choice._check_backward(chunk_gated_delta_rule, torch.device("cpu"))
        verdict = "passed"
    except RuntimeError as exc:
        verdict = str(exc)
    return error, verdict


def unguarded_step():
    """FLA's own step where FLA refuses it (a Hopper GPU with Triton 3.6, simulated through the flags its guard
    reads): the guard's verdict, then FLA's whole backward with its own step past the guard
    (`unguarded_fla_dqkwg`) through `_check_backward` with 2 key heads of 4 value heads of sizes 32 x 16 (q/k heads
    shared as transformers repeats them), and the guard's flag afterwards."""
    import fla.ops.common.chunk_o as chunk_o
    import fla.ops.gated_delta_rule.chunk as fla_chunk
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    import grpo.kernels.gdn_choice as gdn_choice

    cpu = torch.device("cpu")
    fla_chunk.chunk_bwd_dqkwg = fla_dqkwg  # FLA's own again (whole_backward left a broken step in)
    chunk_o.IS_NVIDIA_HOPPER, chunk_o.TRITON_ABOVE_3_4_0, chunk_o.TRITON_ABOVE_3_7_1 = True, True, False
    try:
        gdn_choice._check_backward(chunk_gated_delta_rule, cpu, (2, 4, 32, 16))
        refused = "ran"
    except RuntimeError as exc:
        refused = str(exc)
    fla_chunk.chunk_bwd_dqkwg = gdn_choice.unguarded_fla_dqkwg(fla_dqkwg)
    error = gdn_choice._check_backward(chunk_gated_delta_rule, cpu, (2, 4, 32, 16))
    return {"refused": refused, "error": error, "flag_after": chunk_o.TRITON_ABOVE_3_7_1}


def lightened_backward():
    """`lighten_fla_launches` (FLA's lookup off, its default): FLA's kernels launched through Triton's autotuner
    directly, and FLA's whole backward with the torch step still equal to the torch kernel."""
    import fla.ops.gated_delta_rule.chunk as fla_chunk
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.utils import cache

    import grpo.kernels.gdn_choice as gdn_choice

    lightened = gdn_choice.lighten_fla_launches()
    fla_chunk.chunk_bwd_dqkwg = chunk_bwd_dqkwg
    return {"lightened": lightened, "direct": cache.CachedAutotuner.run is autotuner.Autotuner.run,
            "error": gdn_choice._check_backward(chunk_gated_delta_rule, torch.device("cpu"))}


results = {
    "fp32 batch 2, 130 tokens (a partial chunk)": case(0, 2, 130, 2, 2, 32, 32),
    "fp32 varlen 70+5+128+64, 2 key heads of 4 value heads": case(1, 0, 0, 2, 4, 32, 16, lens=[70, 5, 128, 64]),
    "fp32 state_v_first, 1 key head of 2": case(2, 2, 64, 1, 2, 16, 32, state_v_first=True),
    "bf16 varlen 100+30": case(3, 0, 0, 2, 2, 32, 32, lens=[100, 30], dtype=torch.bfloat16),
}
whole_error, broken_verdict = whole_backward()
print(json.dumps({"dqkwg": results, "whole_backward_error": whole_error, "broken_step": broken_verdict,
                  "unguarded": unguarded_step(), "lightened": lightened_backward()}))
shutil.rmtree(copy, ignore_errors=True)
