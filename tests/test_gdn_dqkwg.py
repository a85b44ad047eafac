"""grpo/kernels/gdn_dqkwg.py (FLA's gated `chunk_bwd_dqkwg` step in torch) and grpo/kernels/gdn_choice.py's check of an FLA
backward.

The step is compared with FLA's own Triton kernel run by Triton's interpreter on CPU (tests/fla_interpret_dqkwg.py;
fla-core sits in a side folder, .venv/fla-cpu, that `scripts/install.sh cpu` fills: on sys.path it would make
transformers' Qwen3.5 call FLA). The whole FLA backward with the step replaced is checked on a GPU
(tests/test_gpu_step.py) and, at run time, by `_check_backward`, whose verdicts are tested here on torch kernels.
"""

from __future__ import annotations

import pytest
import torch
from fla_interpret import run_interpreted


def test_torch_dqkwg_equals_flas_kernel_in_the_triton_interpreter():
    """Step against step in four cases (partial chunks, varlen with grouped heads, [V, K] states, bf16), then FLA's
    whole backward with the torch step against the torch kernel, a broken step refused by the check, FLA's own
    step past its Triton guard (the guard's flag back afterwards), and the backward launched without FLA's
    per-launch lookup key (`lighten_fla_launches`)."""
    report = run_interpreted("fla_interpret_dqkwg.py")
    assert len(report["dqkwg"]) == 4
    for name, errors in report["dqkwg"].items():
        tol = 2e-2 if name.startswith("bf16") else 1e-5  # bf16: FLA got fp32 values, so no rounding of dS
        assert all(error < tol for error in errors.values()), f"{name}: {errors}"
    assert report["whole_backward_error"] < 1e-4  # FLA's whole backward with the torch step == the torch kernel
    assert report["broken_step"].startswith("dk is off by"), report["broken_step"]
    unguarded = report["unguarded"]  # FLA's own step where its guard refuses it, then run past the guard
    assert "Triton >= 3.4.0" in unguarded["refused"], unguarded["refused"]
    assert unguarded["error"] < 1e-4 and unguarded["flag_after"] is False
    lightened = report["lightened"]  # launched through Triton's autotuner directly, the same backward
    assert lightened["lightened"] and lightened["direct"] and lightened["error"] < 1e-4, lightened


def test_dqkwg_rejects_what_it_does_not_cover():
    from grpo.kernels.gdn_dqkwg import chunk_bwd_dqkwg

    x = torch.zeros(1, 4, 1, 8)
    with pytest.raises(NotImplementedError, match="gated delta rule"):
        chunk_bwd_dqkwg(x, x, x, x, torch.zeros(1, 1, 1, 8, 8), torch.zeros(1, 1, 1, 8, 8))


def _varlen_torch_rule(scale_dk: float = 1.0, tiled: bool = False):
    """FLA's varlen signature over grpo.kernels.gdn_kernel's torch kernel, segment by segment, grouped q/k heads shared by
    consecutive value heads (`tiled`: by every H_k-th, a wrong grouping); `scale_dk` != 1 scales the key gradient
    (a wrong backward with a correct forward)."""
    from grpo.kernels.gdn_kernel import chunk_gated_delta_rule

    class ScaleGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad * scale_dk

    def rule(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, cu_seqlens_cpu,
             use_qk_l2norm_in_kernel):
        k = ScaleGrad.apply(k)
        group = v.shape[2] // q.shape[2]
        q, k = (t.repeat(1, 1, group, 1) if tiled else t.repeat_interleave(group, dim=2) for t in (q, k))
        bounds = cu_seqlens_cpu.tolist()
        outs, finals = [], []
        for seg, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            o, f = chunk_gated_delta_rule(*(t[:, lo:hi].float() for t in (q, k, v, g, beta)), output_final_state=True,
                                          initial_state=None if initial_state is None else initial_state[seg:seg + 1],
                                          use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
            outs.append(o)
            finals.append(f)
        return torch.cat(outs, 1).to(q.dtype), torch.cat(finals, 0)

    return rule


def test_backward_check_passes_a_correct_backward_and_fails_a_wrong_one():
    """At equal and at grouped head counts: a correct rule passes; a wrong key gradient, or q/k heads shared by the
    wrong value heads, fails."""
    from grpo.kernels.gdn_choice import BACKWARD_CHECK_TOL, _check_backward

    cpu = torch.device("cpu")
    for heads in [(2, 2, 64, 64), (2, 4, 32, 16)]:  # grouped: 2 key heads of 4 value heads
        assert _check_backward(_varlen_torch_rule(), cpu, heads) < BACKWARD_CHECK_TOL  # bf16 vs the fp32 reference
        with pytest.raises(RuntimeError, match="dk is off by"):
            _check_backward(_varlen_torch_rule(scale_dk=1.5), cpu, heads)
    with pytest.raises(RuntimeError, match="is off by"):  # q/k heads shared by the wrong value heads
        _check_backward(_varlen_torch_rule(tiled=True), cpu, (2, 4, 32, 16))


def _dqkwg_inputs(lens, heads=2, v_heads=4, d_k=16, d_v=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    length, chunks = sum(lens), sum(-(-n // 64) for n in lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    q, k = (torch.randn(1, length, heads, d_k, generator=gen) for _ in range(2))
    v, do, dv = (torch.randn(1, length, v_heads, d_v, generator=gen) for _ in range(3))
    w = torch.randn(1, length, v_heads, d_k, generator=gen)
    g = -(torch.rand(1, length, v_heads, generator=gen) * 0.3)
    h, dh = (torch.randn(1, chunks, v_heads, d_k, d_v, generator=gen) for _ in range(2))
    seq = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor([-(-n // 64) for n in lens]))
    within = torch.cat([torch.arange(-(-n // 64)) for n in lens])
    return dict(q=q, k=k, v=v, do=do, h=h, dh=dh, w=w, g=g, dv=dv, cu_seqlens=cu), torch.stack([seq, within], 1)


def test_dqkwg_with_flas_chunk_indices_is_sync_free_and_equal():
    """Given FLA's `chunk_indices` (what its backward passes), the varlen step has no data-dependent shape (it runs
    under FakeTensorMode, where a device sync such as mask indexing or repeat_interleave by a tensor raises) and
    equals the step that derives its chunks from cu_seqlens; without them, FakeTensorMode catches that path."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    from grpo.kernels.gdn_dqkwg import chunk_bwd_dqkwg

    inputs, chunk_indices = _dqkwg_inputs([70, 5, 128, 64])
    for got, want in zip(chunk_bwd_dqkwg(**inputs, chunk_indices=chunk_indices), chunk_bwd_dqkwg(**inputs)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {name: mode.from_tensor(t) for name, t in inputs.items()}
        dq, dk, dw, dg = chunk_bwd_dqkwg(**fake, chunk_indices=mode.from_tensor(chunk_indices))
        assert dq.shape == inputs["q"].shape and dg.shape == inputs["g"].shape
        with pytest.raises((DynamicOutputShapeException, DataDependentOutputException)):
            chunk_bwd_dqkwg(**fake)


def test_dqkwg_matmuls_on_cuda_are_16_bit_gemms_with_fp32_results(monkeypatch):
    """The step's matmul on CUDA (`_mm`): 16-bit operands straight into one `torch.bmm(..., out_dtype=float32)`
    (FLA's tl.dot precision), traced on fake CUDA tensors (FakeTensorMode: shapes, dtypes and the op called, no GPU
    needed), for the step's operand layouts ([n, HV, C, D] x a transposed state tile); elsewhere fp32 operands,
    equal on CPU to the product of the same values. The values on a GPU are checked by gdn_choice's backward check
    at start and bench_gdn.py's fla variant."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    import grpo.kernels.gdn_dqkwg as dqkwg

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in ("aten::bmm", "aten::mm", "aten::matmul"):
                self.seen.append((func._overloadname, args[0].dtype, (kwargs or {}).get("out_dtype", args[2:3])))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(dqkwg, "_OUT_DTYPE_GEMM", [])
    with FakeTensorMode():
        a = torch.empty(5, 4, 64, 32, dtype=torch.bfloat16, device="cuda")  # [n, HV, C, D]
        state = torch.empty(5, 4, 32, 16, dtype=torch.bfloat16, device="cuda").transpose(-1, -2)  # [n, HV, V, K]
        with Matmuls() as seen:
            out = dqkwg._mm(a, state.transpose(-1, -2))
            again = dqkwg._mm(a, a.transpose(-1, -2))
    assert dqkwg._OUT_DTYPE_GEMM == [True]
    assert (out.shape, out.dtype, out.device.type) == ((5, 4, 64, 16), torch.float32, "cuda")
    assert again.shape == (5, 4, 64, 64)
    assert [s[:2] for s in seen.seen] == [("dtype", torch.bfloat16)] * 3, seen.seen  # the one-time probe + two
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 2, 8, 4, generator=gen).bfloat16(), torch.randn(3, 2, 4, 5, generator=gen).bfloat16()
    assert dqkwg._mm(x, y).dtype == torch.float32
    torch.testing.assert_close(dqkwg._mm(x, y), x.double() @ y.double(), check_dtype=False, atol=1e-5, rtol=1e-5)
