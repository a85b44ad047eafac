"""Which kernel runs the Gated DeltaNet recurrence where (grpo/gdn.py's tree path calls it): FLA's varlen Triton
kernel or this project's torch kernel, forward and backward judged separately from the installed Triton, the
GPU's compute capability and, for an FLA backward under `auto`, a small probe. `choose_gdn_kernels` is the rule
with its facts as inputs (tested on CPU); `gdn_kernels` reads this machine's facts, decides once per device and
logs the choice (logger `grpo.gdn`, where the tree path logs too).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger("grpo.gdn")

FLA_BAD_BACKWARD_TRITON = ("3.4.0", "3.7.1")
"""[low, high) Triton versions with which FLA's gated chunk backward is wrong on Hopper (FLA raises there)."""


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


@dataclass(frozen=True)
class GdnKernels:
    """The recurrence's kernel per direction: "fla" (varlen Triton) or "torch" (`chunk_gated_delta_rule`).

    `forward` serves forwards that need no gradient; a forward that needs gradients runs on the `backward`
    kernel (a backward differentiates its own forward), so (fla, torch) means: FLA under no_grad, torch in
    training. (torch, fla) never occurs."""

    forward: str
    backward: str
    reason: str

    def for_forward(self, needs_grad: bool) -> str:
        return self.backward if needs_grad else self.forward

    def describe(self) -> str:
        names = {"fla": "fla varlen", "torch": "torch chunked"}
        if self.forward == self.backward:
            fwd = names[self.forward]
        else:
            fwd = f"{names[self.forward]} (no-grad forwards), {names[self.backward]} (forwards that need gradients)"
        bwd = names[self.backward] + (" (autograd)" if self.backward == "torch" else "")
        return f"forward {fwd}; backward {bwd} ({self.reason})"


def choose_gdn_kernels(choice: str, device_type: str, fla_importable: bool, triton_version: str | None,
                       capability: tuple[int, int] | None) -> GdnKernels:
    """The kernel rule (`--gdn-kernel`), with the facts it reads as inputs (so the matrix is testable on CPU).

    torch: torch both ways, whatever is installed. auto: FLA in each direction `fla_directions` accepts when
    `fla` imports on CUDA, else torch. fla: required (errors name the fix when FLA cannot run at all); a
    direction FLA computes wrong on this Triton/GPU still runs on torch.
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
    return GdnKernels("fla" if forward_ok else "torch", "fla" if forward_ok and backward_ok else "torch", reason)


_KERNEL_CHOICE: dict = {}  # (device type, device index, choice) -> (GdnKernels, FLA's varlen rule or None)


def gdn_kernels(choice: str, device: torch.device):
    """(GdnKernels, FLA's varlen rule or None) for `choice` on `device`: `choose_gdn_kernels` on this machine's
    facts; with auto, an FLA backward must also pass a small forward + backward probe (a failure moves it, or
    both directions, to torch). Decided once per device and choice, and logged once (INFO: which kernel runs
    forward and backward, and why)."""
    key = (device.type, device.index, choice)
    if key in _KERNEL_CHOICE:
        return _KERNEL_CHOICE[key]
    fla_rule, import_error, triton_version, capability = None, None, None, None
    if choice != "torch" and device.type == "cuda":
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
        except ImportError as exc:
            import_error = exc
        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            pass
        capability = tuple(torch.cuda.get_device_capability(device))
    try:
        kernels = choose_gdn_kernels(choice, device.type, fla_rule is not None, triton_version, capability)
    except ImportError as exc:
        raise ImportError(f"{exc} ({import_error})") from import_error
    if choice == "auto" and kernels.backward == "fla":  # (fla, torch): no probe, training never compiles FLA
        try:
            _probe(fla_rule, device, backward=True)
        except Exception as exc:  # noqa: BLE001 - any kernel failure means: use the torch path
            failed = f"FLA's kernel failed a probe ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
            kernels = (GdnKernels("fla", "torch", f"{kernels.reason}; backward: {failed}")
                       if _forward_probe_passes(fla_rule, device) else GdnKernels("torch", "torch", failed))
    log.info("Gated DeltaNet recurrence on %s (gdn_kernel=%s): %s", device, choice, kernels.describe())
    _KERNEL_CHOICE[key] = (kernels, fla_rule if kernels.forward == "fla" else None)
    return _KERNEL_CHOICE[key]


def _forward_probe_passes(rule, device: torch.device) -> bool:
    try:
        _probe(rule, device, backward=False)
    except Exception:  # noqa: BLE001
        return False
    return True


def _probe(rule, device: torch.device, backward: bool) -> None:
    """A two-segment varlen call with an initial state, as the tree path makes it; forward only under no_grad,
    else forward + backward."""
    n, h, d = 64, 2, 64
    with torch.set_grad_enabled(backward):
        q, k, v = (torch.randn(1, n, h, d, device=device, dtype=torch.bfloat16, requires_grad=backward)
                   for _ in range(3))
        g = (-torch.rand(1, n, h, device=device) * 0.1).requires_grad_(backward)
        beta = torch.rand(1, n, h, device=device, dtype=torch.bfloat16, requires_grad=backward)
        h0 = torch.zeros(2, h, d, d, device=device, requires_grad=backward)
        cu = torch.tensor([0, 40, n], device=device)
        out, final = rule(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=cu, cu_seqlens_cpu=cu.cpu())
        if backward:
            (out.float().sum() + final.sum()).backward()
    torch.cuda.synchronize(device)
