"""scripts/profile_sites.py (what bench_step.py --profile prints): eager ops grouped by the Python site that ran
them, backward ops by the forward site whose autograd node ran them."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from profile_sites import print_op_sites  # noqa: E402


def _gathered_product(x, w, index):
    return x[index] * w  # forward: aten::index, aten::mul; backward: IndexBackward0 (index_put), MulBackward0


def test_backward_ops_are_attributed_to_their_forward_site(capsys):
    x = torch.randn(4096, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    index = torch.randint(0, 4096, (8192,))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        (_gathered_product(x, w, index) ** 2).sum().backward()
    print_op_sites(prof, "self_cpu_time_total", top=50)
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("OP SITES")
    here = "test_bench_step.py("
    assert any("fwd aten::mul " in r and here in r and "_gathered_product" in r for r in rows), rows
    assert any("fwd aten::index " in r and here in r for r in rows), rows
    # the backward runs on autograd's thread without Python frames: named by node and forward site instead
    assert any(r.split("x  ", 1)[-1].startswith("bwd aten::mul in") and "MulBackward0 of mul at" in r and here in r
               for r in rows), rows
    assert any("IndexBackward0 of index at" in r and here in r for r in rows), rows
    assert not any("(no Python frame)" in r and "bwd" not in r for r in rows)
    assert rows[-1].startswith("HOST SYNCS: none recorded")  # a CPU run has no CUDA runtime events


def _event(id_, start, end, device, linked=0, name="k"):
    from types import SimpleNamespace

    return SimpleNamespace(id=id_, name=name, device_type=f"DeviceType.{device}", linked_correlation_id=linked,
                           time_range=SimpleNamespace(start=start, end=end), cpu_parent=None)


def test_gpu_idle_gaps_merge_overlaps_and_charge_the_launching_op(capsys):
    from profile_sites import gpu_idle_gaps, print_gpu_idle

    mm, copy = _event(1, 0, 1, "CPU", name="aten::mm"), _event(2, 0, 1, "CPU", name="aten::copy_")
    kernels = [_event(10, 0, 10, "CUDA", linked=1), _event(11, 5, 20, "CUDA", linked=1),  # overlap: busy 0..20
               _event(12, 22, 30, "CUDA", linked=2),  # 2 us gap: under the 5 us floor, idle but not listed
               _event(13, 130, 150, "CUDA", linked=1), _event(14, 160, 170, "CUDA", linked=99)]
    busy, span, gaps = gpu_idle_gaps([mm, copy, *reversed(kernels)])
    assert (busy, span) == (20 + 8 + 20 + 10, 170)
    assert [(g, op.name if op else None) for g, op in gaps] == [(100, "aten::mm"), (10, None)]
    print_gpu_idle([mm, copy, *kernels], lambda e, label: f"fwd {label}")
    rows = capsys.readouterr().out.splitlines()
    assert rows[0].startswith("GPU IDLE (0.2 ms from the first kernel to the last: busy 0.1 ms, idle 0.1 ms (66 %)")
    assert "fwd aten::mm" in rows[1] and "(launching op unknown)" in rows[2]


def test_gpu_idle_falls_back_to_the_last_launch_before_the_work():
    """A profiler without correlation links: the work after a gap is charged to the op around the last launch
    call that started before it."""
    from profile_sites import gpu_idle_gaps

    mm, add = _event(1, 0, 200, "CPU", name="aten::mm"), _event(2, 0, 200, "CPU", name="aten::add")
    launch_mm, launch_add = _event(3, 40, 45, "CPU", name="cudaLaunchKernel"), _event(4, 90, 95, "CPU",
                                                                                       name="cudaLaunchKernel")
    launch_mm.cpu_parent, launch_add.cpu_parent = mm, add
    kernels = [_event(10, 0, 10, "CUDA"), _event(11, 50, 60, "CUDA"), _event(12, 100, 110, "CUDA")]
    _, _, gaps = gpu_idle_gaps([mm, add, launch_mm, launch_add, *kernels])
    assert [(g, op.name) for g, op in gaps] == [(40, "aten::mm"), (40, "aten::add")]


def test_cpp_wrapper_switch_compiles_under_it_and_restores_the_config():
    """bench_step's `bench_cpp_wrapper=true`: a layer with the split attention op inside (what a compiled decoder
    layer holds on a GPU; here its dense reference) compiles through inductor's C++ wrapper, forward and backward,
    and computes what eager does; the process's inductor config is as before afterwards."""
    import random

    import torch._inductor.config as inductor_config
    from bench_patches import inductor_cpp_wrapper
    from test_tree_split import random_row_samples
    from torch._inductor.utils import run_and_get_code

    from grpo.kernels.tree_split import plan_tensors, split_attention_in_graph
    from grpo.trie import pack_samples

    row = pack_samples(random_row_samples(random.Random(11), "shared_prompt"))
    n, gen = row.num_tokens, torch.Generator().manual_seed(0)
    w, x = torch.randn(16, 16, generator=gen, requires_grad=True), torch.randn(n, 16, generator=gen)

    def layer(x, w, plan):
        h = torch.nn.functional.silu(x @ w)
        q, k, v = h.view(n, 4, 4), h[:, :8].reshape(n, 2, 4), h[:, 8:].reshape(n, 2, 4)
        return (split_attention_in_graph(plan, q, k, v, 0.5, False) * 1.5).square().mean()

    want = layer(x, w, plan_tensors(row))
    before = inductor_config.cpp_wrapper
    with inductor_cpp_wrapper():
        got, code = run_and_get_code(torch.compile(layer, dynamic=True), x, w, plan_tensors(row))
        assert "inductor_entry_impl" in code[0]  # the C++ entry point of cpp_wrapper's generated module
        torch.testing.assert_close(torch.autograd.grad(got, w), torch.autograd.grad(want, w))
    assert inductor_config.cpp_wrapper == before
    torch.testing.assert_close(got, want)
