"""Which kernel runs the Gated DeltaNet recurrence where (grpo/kernels/gdn.py's tree path calls it): FLA's varlen Triton
kernel or this project's torch kernel, forward and backward judged separately from the installed Triton, the
GPU's compute capability and, for an FLA backward under `auto`, a small probe. `choose_gdn_kernels` is the rule
with its facts as inputs (tested on CPU); `gdn_kernels` reads this machine's facts, decides once per device and
logs the choice (logger `grpo.kernels.gdn`, where the tree path logs too). `transformers_torch_reference` is the other side
of that choice: transformers' own torch GDN functions for unpacked reference forwards, whatever it bound to FLA.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from dataclasses import dataclass, replace

import torch

from grpo.progress import heartbeat

log = logging.getLogger("grpo.kernels.gdn")

FLA_BAD_BACKWARD_TRITON = ("3.4.0", "3.7.1")
"""[low, high) Triton versions with which FLA's gated chunk backward is wrong on Hopper (FLA raises there)."""

PROBE_HEADS = (2, 2, 64, 64)
"""(H_k, H_v, D_k, D_v) of the kernel checks when the caller names no layer."""


def fla_directions(triton_version: str | None, capability: tuple[int, int] | None) -> tuple[bool, bool, str]:
    """(forward_ok, backward_ok, reason): whether FLA's gated delta-rule kernels compute correct results with
    Triton `triton_version` on a CUDA device of compute `capability` (None: no Triton / no CUDA device).

    FLA's forward kernels are correct wherever Triton runs. Its gated chunk backward (`chunk_bwd_dqkwg`) gives
    wrong results with Triton >= 3.4.0, < 3.7.1 on Hopper (compute capability 9.x) and FLA raises there; FLA's
    alternative for that case, a tilelang backend, needs a working nvcc at run time and is not relied on here.
    """
    from packaging.version import Version

    if capability is None:
        return False, False, "FLA's kernels need a CUDA device"
    if triton_version is None:
        return False, False, "FLA's kernels need Triton (not installed)"
    low, high = FLA_BAD_BACKWARD_TRITON
    if capability[0] == 9 and Version(low) <= Version(triton_version) < Version(high):
        return True, False, (f"FLA's gated chunk backward is wrong with Triton {triton_version} on Hopper "
                             f"(sm_{capability[0]}{capability[1]}); Triton >= {high} fixes it")
    return True, True, f"FLA accepts Triton {triton_version} on sm_{capability[0]}{capability[1]}"


def _dqkwg_replaceable() -> bool:
    try:
        import fla.ops.gated_delta_rule.chunk as fla_chunk
    except ImportError:
        return False
    return callable(getattr(fla_chunk, "chunk_bwd_dqkwg", None))


def _set_dqkwg(step) -> None:
    import fla.ops.gated_delta_rule.chunk as fla_chunk

    fla_chunk.chunk_bwd_dqkwg = step


def unguarded_fla_dqkwg(own):
    """FLA's own `chunk_bwd_dqkwg` (`own`, as FLA's gated chunk backward imports it) run past the Triton/Hopper guard
    FLA puts in front of it, or None when this FLA has no such guard to lift (`TRITON_ABOVE_3_7_1` of
    fla.ops.common.chunk_o). The miscompile FLA guards against (FLA issue #640) was bisected to one tiling, a 64-wide
    key block (BK = 64); on Hopper FLA tiles 128-wide, so K = 128 heads may run correct. `gdn_kernels` uses this only
    after it passed `_check_backward` at the model's own heads on this GPU."""
    try:
        import fla.ops.common.chunk_o as chunk_o
    except ImportError:
        return None
    if not isinstance(getattr(chunk_o, "TRITON_ABOVE_3_7_1", None), bool):
        return None

    @functools.wraps(own)
    def unguarded(*args, **kwargs):
        lifted = chunk_o.TRITON_ABOVE_3_7_1
        chunk_o.TRITON_ABOVE_3_7_1 = True  # the flag the guard reads; nothing else in that module reads it
        try:
            return own(*args, **kwargs)
        finally:
            chunk_o.TRITON_ABOVE_3_7_1 = lifted

    return unguarded


def flas_own_dqkwg():
    """FLA's own `chunk_bwd_dqkwg`: the step FLA's gated chunk backward module held before this project first
    replaced it (remembered on that module), None when this FLA has no such step (its module layout changed)."""
    if not _dqkwg_replaceable():
        return None
    import fla.ops.gated_delta_rule.chunk as fla_chunk

    if not hasattr(fla_chunk, "_grpo_flas_own_dqkwg"):
        fla_chunk._grpo_flas_own_dqkwg = fla_chunk.chunk_bwd_dqkwg
    return fla_chunk._grpo_flas_own_dqkwg


def install_torch_dqkwg():
    """Put grpo/kernels/gdn_dqkwg.py's `chunk_bwd_dqkwg` in place of FLA's own in FLA's gated delta-rule backward (the one
    step FLA refuses on Hopper with Triton >= 3.4.0, < 3.7.1; every other FLA kernel stays). Process-wide: also
    transformers' Qwen3.5 layers, which call FLA's kernel when `fla` imports, get it. Returns FLA's own step
    (`flas_own_dqkwg`, to put back with `_set_dqkwg`), None when this FLA has no such step."""
    flas_own = flas_own_dqkwg()
    if flas_own is not None:
        from grpo.kernels.gdn_dqkwg import chunk_bwd_dqkwg

        _set_dqkwg(chunk_bwd_dqkwg)
    return flas_own


def lighten_fla_launches() -> bool:
    """Launch FLA's kernels through Triton's autotuner directly while FLA's config lookup is off (FLA_CACHE_MODE
    unset or `disabled`, FLA's default). FLA wraps each kernel in `CachedAutotuner`, whose `run` builds a lookup key
    of every launch's arguments (a dict of them, a dtype string per tensor) and, with the lookup off, then calls
    Triton's `Autotuner.run` anyway: the key is built for nothing, at every launch (~20 launches per GDN layer and
    trie level, forward and backward). Idempotent; False (nothing changed) when FLA's lookup is on or its layout
    differs."""
    try:
        from fla.ops.utils import cache
    except ImportError:
        return False
    mode, wrapper = getattr(cache, "FLA_CACHE_MODE", None), getattr(cache, "CachedAutotuner", None)
    modes = getattr(cache, "FlaCacheMode", None)
    if modes is None or wrapper is None or mode is not getattr(modes, "DISABLED", object()):
        return False
    base = next((c for c in wrapper.__mro__[1:] if "run" in vars(c)), None)
    if base is None:
        return False
    wrapper.run = base.run
    return True


@dataclass(frozen=True)
class GdnKernels:
    """The recurrence's kernel per direction: "fla" (varlen Triton) or "torch" (`chunk_gated_delta_rule`).

    `forward` serves forwards that need no gradient; a forward that needs gradients runs on the `backward`
    kernel (a backward differentiates its own forward), so (fla, torch) means: FLA under no_grad, torch in
    training. (torch, fla) never occurs. `torch_dqkwg`: FLA's backward runs with its `chunk_bwd_dqkwg` step
    replaced by grpo/kernels/gdn_dqkwg.py's (`install_torch_dqkwg`)."""

    forward: str
    backward: str
    reason: str
    torch_dqkwg: bool = False
    unguarded_dqkwg: bool = False  # FLA's own dqkwg step past its guard (`unguarded_fla_dqkwg`), checked here
    one_pass: bool = False  # FLA runs a trie row in one pass (grpo/kernels/gdn_fla.py `FlaTreeRule`), checked here

    def for_forward(self, needs_grad: bool) -> str:
        return self.backward if needs_grad else self.forward

    def describe(self) -> str:
        names = {"fla": "fla varlen", "torch": "torch chunked"}
        if self.forward == self.backward:
            fwd = names[self.forward]
        else:
            fwd = f"{names[self.forward]} (no-grad forwards), {names[self.backward]} (forwards that need gradients)"
        bwd = names[self.backward] + (" (autograd)" if self.backward == "torch" else "")
        if self.torch_dqkwg and self.backward == "fla":
            bwd += " with its chunk_bwd_dqkwg step in torch (grpo/kernels/gdn_dqkwg.py)"
        if self.unguarded_dqkwg and self.backward == "fla":
            bwd += " with its own chunk_bwd_dqkwg run past its Triton guard (checked on this GPU)"
        if "fla" in (self.forward, self.backward):
            bwd += ("; fla in one pass per trie row, its state kernels per level" if self.one_pass
                    else "; fla called once per trie level")
        return f"forward {fwd}; backward {bwd} ({self.reason})"


def choose_gdn_kernels(choice: str, device_type: str, fla_importable: bool, triton_version: str | None,
                       capability: tuple[int, int] | None, dqkwg_replaceable: bool = False) -> GdnKernels:
    """The kernel rule (`--gdn-kernel`), with the facts it reads as inputs (so the matrix is testable on CPU).

    torch: torch both ways, whatever is installed. auto: FLA in each direction `fla_directions` accepts when
    `fla` imports on CUDA, else torch. fla: required (errors name the fix when FLA cannot run at all); a
    direction FLA computes wrong on this Triton/GPU still runs on torch. Where only FLA's backward is refused
    (its `chunk_bwd_dqkwg` step) and that step can be replaced (`dqkwg_replaceable`), auto and fla run FLA's
    backward with the step in torch (`torch_dqkwg`; `gdn_kernels` checks it against the torch kernel first).
    """
    if choice not in ("auto", "fla", "torch"):
        raise ValueError(f"gdn_kernel must be auto, fla or torch, got {choice!r}")
    if choice == "torch":
        return GdnKernels("torch", "torch", "gdn_kernel=torch")
    if device_type != "cuda":
        if choice == "fla":
            raise ValueError(f"gdn_kernel='fla' needs a CUDA device (got {device_type}); use auto or torch")
        return GdnKernels("torch", "torch", f"FLA's kernels need CUDA, this is {device_type}")
    if not fla_importable:
        if choice == "fla":
            raise ImportError("gdn_kernel='fla' needs flash-linear-attention's kernels: pip install fla-core")
        return GdnKernels("torch", "torch", "fla not installed: pip install fla-core")
    forward_ok, backward_ok, reason = fla_directions(triton_version, capability)
    if not forward_ok and choice == "fla":
        raise RuntimeError(f"gdn_kernel='fla': {reason}")
    if forward_ok and not backward_ok and dqkwg_replaceable:
        return GdnKernels("fla", "fla", reason, torch_dqkwg=True)
    return GdnKernels("fla" if forward_ok else "torch", "fla" if forward_ok and backward_ok else "torch", reason)


_KERNEL_CHOICE: dict = {}  # (device type, device index, choice, heads) -> (GdnKernels, FLA's rule or None)


def gdn_kernels(choice: str, device: torch.device, heads: tuple[int, int, int, int] = PROBE_HEADS):
    """(GdnKernels, FLA's varlen rule or None) for `choice` on `device`: `choose_gdn_kernels` on this machine's
    facts. An FLA backward must first match the torch kernel on a small varlen case with the layer's `heads` (H_k,
    H_v, D_k, D_v) (`_check_backward`), under auto always and under fla when FLA refuses its dqkwg step; there
    `_settle_dqkwg` tries FLA's own step past its guard, then the torch step. A failure moves the backward (or,
    when FLA's forward fails too, both directions) to torch. Decided once per device, choice and heads, and
    logged once (INFO: which kernel runs forward and backward, and why)."""
    key = (device.type, device.index, choice, tuple(heads))
    if key in _KERNEL_CHOICE:
        return _KERNEL_CHOICE[key]
    fla_rule, import_error, triton_version, capability, replaceable = None, None, None, None, False
    if choice != "torch" and device.type == "cuda":
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
        except ImportError as exc:
            import_error = exc
        replaceable = fla_rule is not None and _dqkwg_replaceable()
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            pass
        capability = tuple(torch.cuda.get_device_capability(device))
    try:
        kernels = choose_gdn_kernels(choice, device.type, fla_rule is not None, triton_version, capability,
                                     replaceable)
    except ImportError as exc:
        raise ImportError(f"{exc} ({import_error})") from import_error
    if kernels.torch_dqkwg or kernels.backward == "fla" and choice == "auto":
        log.info("Gated DeltaNet: checking FLA's backward against the torch kernel on %s. FLA's first use with an "
                 "empty Triton cache autotunes its kernels (minutes on an H200; a line every 30 s until done); the "
                 "results are kept in the Triton cache (TRITON_CACHE_DIR, else ~/.triton/cache), so later runs start "
                 "in seconds. --gdn-kernel torch skips FLA", device)
        with heartbeat(f"FLA's Gated DeltaNet check on {device} (Triton autotunes FLA's kernels on first use)",
                       CHECK_PROGRESS_S):
            kernels = _checked(kernels, fla_rule, device, heads)
    if "fla" in (kernels.forward, kernels.backward):
        lighten_fla_launches()
        kernels = _settle_one_pass(kernels, fla_rule, device, heads)
    log.info("Gated DeltaNet recurrence on %s (gdn_kernel=%s): %s", device, choice, kernels.describe())
    _KERNEL_CHOICE[key] = (kernels, fla_rule if kernels.forward == "fla" else None)
    return _KERNEL_CHOICE[key]


def _checked(kernels: GdnKernels, fla_rule, device: torch.device, heads: tuple[int, ...]) -> GdnKernels:
    """`kernels` after FLA's backward is checked at `heads`: its refused step settled, or the backward on torch."""
    if kernels.torch_dqkwg:
        return _settle_dqkwg(kernels, fla_rule, device, heads)
    try:
        _check_backward(fla_rule, device, heads)
    except Exception as exc:  # noqa: BLE001 - any kernel failure or mismatch means: use the torch path
        return _backward_to_torch(kernels, fla_rule, device, [_failure("FLA's backward", exc)])
    return kernels


def _settle_dqkwg(kernels: GdnKernels, fla_rule, device: torch.device, heads: tuple[int, ...]) -> GdnKernels:
    """FLA refuses its gated dqkwg step on this Triton/GPU: put in the first step with which FLA's whole backward
    passes `_check_backward` at `heads` — FLA's own past its guard (`unguarded_fla_dqkwg`; skipped with
    GRPO_FLA_DQKWG=torch), then grpo/kernels/gdn_dqkwg.py's — or FLA's own back (it raises, never returns wrong) and the
    backward on torch."""
    from grpo.kernels.gdn_dqkwg import chunk_bwd_dqkwg

    flas_own = flas_own_dqkwg()  # each step below is put in before its check

    steps = [("torch", chunk_bwd_dqkwg)]
    unguarded = unguarded_fla_dqkwg(flas_own) if os.environ.get("GRPO_FLA_DQKWG", "auto") != "torch" else None
    if unguarded is not None:
        steps.insert(0, ("unguarded", unguarded))
    failures = []
    for name, step in steps:
        _set_dqkwg(step)
        try:
            _check_backward(fla_rule, device, heads)
        except Exception as exc:  # noqa: BLE001 - any kernel failure or mismatch: try the next step
            failures.append(_failure("FLA's own dqkwg step past its guard" if name == "unguarded"
                                     else "FLA's backward with the torch dqkwg step", exc))
            continue
        reason = kernels.reason + "".join(f"; {f}" for f in failures)
        return replace(kernels, reason=reason, torch_dqkwg=name == "torch", unguarded_dqkwg=name == "unguarded")
    _set_dqkwg(flas_own)
    return _backward_to_torch(kernels, fla_rule, device, failures)


def _failure(what: str, exc: BaseException) -> str:
    return f"{what} failed its check ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"


def _backward_to_torch(kernels: GdnKernels, fla_rule, device: torch.device, failures: list[str]) -> GdnKernels:
    failed = "; ".join(failures)
    if _forward_probe_passes(fla_rule, device):
        return GdnKernels("fla", "torch", f"{kernels.reason}; {failed}")
    return GdnKernels("torch", "torch", failed)


def _settle_one_pass(kernels: GdnKernels, fla_rule, device: torch.device, heads: tuple[int, ...]) -> GdnKernels:
    """`kernels` with `one_pass` on where grpo/kernels/gdn_fla.py's one-pass tree rule runs with this fla-core and equals
    FLA's public kernel called per trie level (itself checked against the torch kernel above) on a small tree row at
    `heads` (`_check_one_pass`); else unchanged, the reason added."""
    from grpo.kernels.gdn_fla import fla_tree_kernels

    if fla_tree_kernels() is None:
        return replace(kernels, reason=f"{kernels.reason}; this fla-core's state kernels take other arguments "
                                       "than grpo/kernels/gdn_fla.py launches them with")
    try:
        _check_one_pass(fla_rule, device, heads, backward=kernels.backward == "fla")
    except Exception as exc:  # noqa: BLE001 - any failure or mismatch: FLA's public kernel per level, as before
        return replace(kernels, reason=f"{kernels.reason}; {_failure('FLA in one pass per row', exc)}")
    return replace(kernels, one_pass=True)


def _check_one_pass(fla_rule, device: torch.device, heads: tuple[int, int, int, int], backward: bool) -> float:
    """The one-pass tree rule against FLA's public kernel per level on a two-level row in DFS order (two roots of
    64 and 20 tokens, a 40- and a 20-token child; `_probe_inputs`' 144 tokens, q and k L2-normalised as the tree
    conv hands them over): the output and, with `backward`, the q, k, v, g, beta gradients within 1e-2 of each
    value's scale (both run FLA's kernels on the same chunks, so they agree to rounding); returns the largest error,
    raises RuntimeError above it."""
    from grpo.kernels.gdn_fla import tree_fla_gated_delta_rule, tree_varlen_gated_delta_rule
    from grpo.kernels.gdn_kernel import l2norm
    from grpo.kernels.gdn_plan import plan_tree_scan

    token_pred = torch.arange(-1, 143)
    token_pred[[64, 104, 124]] = torch.tensor([63, -1, 123])
    plan = plan_tree_scan(token_pred.to(device), torch.tensor([0, 64, 104, 124, 144], device=device),
                          torch.tensor([-1, 0, -1, 2], device=device), 4)
    inputs = [t.squeeze(0) for t in _probe_inputs(device, backward, heads)[:5]]
    weights = torch.randn(144, heads[1], heads[3], generator=torch.Generator().manual_seed(2)).to(device)
    results = []
    for run in (lambda *t: tree_fla_gated_delta_rule(*t, plan),
                lambda *t: tree_varlen_gated_delta_rule(fla_rule, *t, plan, use_qk_l2norm_in_kernel=False)):
        leaves = [t.detach().clone().requires_grad_(backward) for t in inputs]
        with torch.set_grad_enabled(backward):
            q, k = (l2norm(x.float()).to(x.dtype) for x in leaves[:2])
            out = run(q, k, *leaves[2:])
        grads = torch.autograd.grad((out.float() * weights).sum(), leaves) if backward else []
        results.append([out.detach().float()] + [g.float() for g in grads])
    errors = _scale_errors(["out", "dq", "dk", "dv", "dg", "dbeta"], *results)
    if max(errors.values()) > 1e-2:
        raise RuntimeError("differs from FLA per trie level: " + ", ".join(f"{n} {e:.3g}" for n, e in errors.items()))
    return max(errors.values())


def _scale_errors(names: list[str], got: list[torch.Tensor], want: list[torch.Tensor]) -> dict[str, float]:
    """name -> max |got - want| as a fraction of want's largest magnitude."""
    return {name: float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) for name, a, b in zip(names, got, want)}


CHECK_PROGRESS_S = 30.0
"""Seconds between the "still waiting for FLA's Gated DeltaNet check" lines while FLA's check (autotuning) runs."""

BACKWARD_CHECK_TOL = 3e-2
"""Largest error an FLA backward may show against the torch kernel in `_check_backward`, as a fraction of each
value's largest magnitude (bf16 inputs; the wrong gradients FLA guards against are off by ~50 %)."""


def _forward_probe_passes(rule, device: torch.device) -> bool:
    try:
        with torch.no_grad():
            rule(*_probe_inputs(device, grad=False)[:5], **_probe_kwargs(device))
        torch.cuda.synchronize(device)
    except Exception:  # noqa: BLE001
        return False
    return True


def _probe_inputs(device: torch.device, grad: bool, heads: tuple[int, int, int, int] = PROBE_HEADS):
    """q, k, v, g, beta, h0 of a two-segment varlen call (64 and 80 tokens; `heads` = (H_k, H_v, D_k, D_v)), as
    the tree path makes it: bf16 q/k [1, N, H_k, D_k], v [1, N, H_v, D_v] and beta, fp32 gates and initial
    states [2, H_v, D_k, D_v]."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    n, (h_k, h_v, d_k, d_v) = 144, heads

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(grad)

    q, k, v = rand(1, n, h_k, d_k), rand(1, n, h_k, d_k), rand(1, n, h_v, d_v)
    g = (-torch.rand(1, n, h_v, generator=gen) * 0.2).to(device).requires_grad_(grad)
    beta = torch.rand(1, n, h_v, generator=gen).to(device=device, dtype=torch.bfloat16).requires_grad_(grad)
    h0 = (torch.randn(2, h_v, d_k, d_v, generator=gen) * 0.1).to(device).requires_grad_(grad)
    return q, k, v, g, beta, h0


def _probe_kwargs(device: torch.device) -> dict:
    cu = torch.tensor([0, 64, 144])
    return {"cu_seqlens": cu.to(device), "cu_seqlens_cpu": cu, "use_qk_l2norm_in_kernel": True}


def _check_backward(rule, device: torch.device, heads: tuple[int, int, int, int] = PROBE_HEADS) -> float:
    """FLA's varlen forward + backward vs grpo.kernels.gdn_kernel's torch kernel (fp32, segment by segment, the q/k heads
    repeated to the value heads as transformers does) on the same inputs, with initial states and without (a
    trie's root level has none: another of FLA's compiled variants): outputs, final states and every gradient (q,
    k, v, g, beta, initial state) within `BACKWARD_CHECK_TOL` of each value's scale; returns the largest such
    error, raises RuntimeError above it. At the layer's `heads` it also autotunes (on first use) the kernels the
    training calls will use, while the caller's progress lines run."""
    return max(_check_once(rule, device, heads, with_states) for with_states in (True, False))


def _check_once(rule, device: torch.device, heads: tuple[int, int, int, int], with_states: bool) -> float:
    from grpo.kernels.gdn_kernel import chunk_gated_delta_rule

    inputs = list(_probe_inputs(device, True, heads))[:6 if with_states else 5]
    h0 = inputs[5] if with_states else None
    out, final = rule(*inputs[:5], initial_state=h0, output_final_state=True, **_probe_kwargs(device))
    weights = torch.randn(out.shape, generator=torch.Generator(device="cpu").manual_seed(1)).to(device)
    ((out.float() * weights).sum() + final.float().sum()).backward()
    got = [out.detach().float(), final.detach().float()] + [t.grad.float() for t in inputs]
    ref_inputs = [t.detach().float().requires_grad_() for t in inputs]
    q, k = (t.repeat_interleave(heads[1] // heads[0], dim=2) for t in ref_inputs[:2])  # [1, N, H_v, D_k]
    outs, finals = [], []
    for seg, (lo, hi) in enumerate([(0, 64), (64, 144)]):
        o, f = chunk_gated_delta_rule(*(t[:, lo:hi] for t in [q, k] + ref_inputs[2:5]), output_final_state=True,
                                      initial_state=ref_inputs[5][seg:seg + 1] if with_states else None,
                                      use_qk_l2norm_in_kernel=True)
        outs.append(o)
        finals.append(f)
    ref_out, ref_final = torch.cat(outs, 1), torch.cat(finals, 0)
    ((ref_out * weights).sum() + ref_final.sum()).backward()
    want = [ref_out.detach(), ref_final.detach()] + [t.grad for t in ref_inputs]
    names = ["out", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errors = _scale_errors(names, got, want)
    worst = max(errors, key=errors.get)
    if errors[worst] > BACKWARD_CHECK_TOL:
        raise RuntimeError(f"{worst} is off by {errors[worst]:.3g} of its scale (tolerance {BACKWARD_CHECK_TOL}"
                           f"{'' if with_states else ', without initial states'})")
    return errors[worst]


# ---- transformers' own torch GDN functions, for reference forwards that must not reach FLA ----------------------

TRANSFORMERS_GDN_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule", "causal_conv1d_fn",
                              "causal_conv1d_update")
"""Module-level functions of transformers' GDN modelling files that it binds to FLA / causal-conv1d when those
import."""


@contextlib.contextmanager
def transformers_torch_reference(model):
    """Inside: `model`'s unpacked GDN layers (transformers' own forward) run transformers' torch functions, whatever
    FLA / causal-conv1d binding it made at import (the function under each `TRANSFORMERS_GDN_FUNCTIONS` name of the
    layers' modelling modules; restored on exit). For per-sample reference forwards that must not reach FLA (its
    kernels autotune per length, and its gated backward is refused on some Triton/GPU pairs)."""
    import sys

    saved = []
    for module in {sys.modules[type(m).__module__] for m in model.modules() if is_gdn_layer(m)}:
        for name in TRANSFORMERS_GDN_FUNCTIONS:
            bound = getattr(module, name, None)
            torch_fn = _torch_function(bound) if bound is not None else None
            if torch_fn is not None:
                saved.append((module, name, bound))
                setattr(module, name, _accepting(torch_fn))
    try:
        yield
    finally:
        for module, name, bound in saved:
            setattr(module, name, bound)


def _torch_function(bound):
    """The torch function under transformers' kernel binding of it: a function wrapped with functools.wraps
    (`__wrapped__`), possibly inside the `kernels` library's function module (its `forward` closes over it)."""
    import inspect

    candidates = [bound]
    forward = getattr(type(bound), "forward", None) if isinstance(bound, torch.nn.Module) else None
    candidates += [cell.cell_contents for cell in getattr(forward, "__closure__", None) or ()]
    for candidate in candidates:
        if callable(candidate) and hasattr(candidate, "__wrapped__"):
            return inspect.unwrap(candidate)
    return None


def _accepting(fn):
    """`fn` called with only the keyword arguments it takes (transformers' wrappers filter the same way)."""
    import inspect

    params = set(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})

    return call


def is_gdn_layer(module) -> bool:
    """True for Qwen3.5-style GDN modules (fused in_proj_qkv + separate z/b/a projections, one conv1d)."""
    return type(module).__name__.endswith("GatedDeltaNet") and all(
        hasattr(module, name) for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d"))
