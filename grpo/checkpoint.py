"""Checkpoints and exact resume.

A checkpoint directory `checkpoint-<step>` holds the model in Hugging Face format (safetensors, loadable with
`from_pretrained`), the tokenizer, `optimizer.pt` + `scheduler.pt` (full, unsharded state), `rng_rank<r>.pt`, and
`rollout_state.json` = {"prompt_index": first prompt position not yet consumed (a low-water mark over trained,
dropped and filtered groups), "consumed_above": consumed positions above it, "partial": positions whose group was
partly trained (the rest of its samples died with the run), "model_version": v, "step": step}. A resumed run skips
every consumed position, so each prompt is trained at most once per epoch across restarts (`grpo/ledger.py`).
Everything is written into `checkpoint-<step>.tmp` and renamed at the end, so a kill during a save never leaves a
directory that looks complete; leftovers of an interrupted save are removed by the next one.

Several nodes: rank 0 writes the checkpoint and every rank reads it back on resume (and writes its own RNG file
into it), so `output_dir` must be one filesystem shared by every node (NFS, Lustre, ...) at the same path;
`check_shared_output_dir` verifies that at start and fails naming the ranks that cannot see rank 0's files.

Security: optimizer, scheduler and RNG state are read with `torch.load(weights_only=True)`, which unpickles only
tensors and plain containers, never code; the model comes from safetensors. A crafted `optimizer.pt` cannot run
anything on resume: the load fails with `UnpicklingError`.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import re
import shutil
import socket
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

_CKPT = re.compile(r"^checkpoint-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := _CKPT.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve_checkpoint(spec: str | None, output_dir: str | Path) -> Path | None:
    """`latest` -> newest complete checkpoint in output_dir (None if there is none); a path -> that path."""
    if spec is None:
        return None
    if spec == "latest":
        ckpts = list_checkpoints(output_dir)
        return ckpts[-1] if ckpts else None
    path = Path(spec)
    if not (path / "rollout_state.json").exists():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no rollout_state.json); "
                                f"pass a checkpoint-<step> directory or `latest`")
    return path


def check_shared_output_dir(output_dir: str | Path, wait_s: float = 10.0) -> None:
    """Collective. Rank 0 writes a token into output_dir; every rank must read it back (multi-node runs need a
    shared output_dir: checkpoints are written by rank 0 and read by all on resume). No-op in one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    out, token = Path(output_dir), [uuid.uuid4().hex if _rank() == 0 else None]
    dist.broadcast_object_list(token)
    probe = out / f".shared_fs_check-{token[0]}"
    if _rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        probe.write_text(token[0])
    _barrier()
    deadline = time.monotonic() + wait_s  # a network filesystem may show a new file a moment late
    while not (seen := probe.exists() and probe.read_text() == token[0]) and time.monotonic() < deadline:
        time.sleep(0.5)
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, (seen, socket.gethostname()))
    _barrier()
    if _rank() == 0:
        probe.unlink()
    blind = [f"rank {r} on {host}" for r, (ok, host) in enumerate(views) if not ok]
    if blind:
        raise RuntimeError(f"output_dir {str(out)!r} is not shared by every node: {', '.join(blind)} cannot read "
                           f"the file rank 0 ({views[0][1]}) wrote there. Checkpoints are written by rank 0 and read "
                           f"by every rank on resume: put --output-dir on a filesystem mounted at the same path on "
                           f"every node (NFS, Lustre, ...)")


def start_state(spec: str | None, output_dir: str | Path, model, optimizer, scheduler,
                log_on_this_rank: bool = True) -> dict:
    """The run's starting bookkeeping: fresh, or restored from the checkpoint `spec` names (`latest` / a path,
    loading model, optimizer, scheduler and RNG). `run_id` is always new: it tells the runs of one output_dir
    apart in trained_prompts.jsonl."""
    import logging

    state = {"prompt_index": 0, "model_version": 0, "step": 0, "consumed_above": [],
             "run_id": f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"}
    path = resolve_checkpoint(spec, output_dir)
    identity = model_identity(model)  # of --model as loaded: the base weights, before any checkpoint
    if path is not None:
        check_model_identity(path, identity)
    if _rank() == 0:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / IDENTITY_FILE).write_text(json.dumps(identity))
    if path is None:
        return state
    state = load_checkpoint(path, model, optimizer, scheduler) | {"run_id": state["run_id"]}
    if log_on_this_rank:
        logging.getLogger("train").info("resumed from %s at step %d, prompt %d", path, state["step"],
                                        state["prompt_index"])
    return state


IDENTITY_FILE = "model_identity.json"
"""Written into output_dir at each run's start and copied into every checkpoint: what a resume compares."""


def model_identity(model) -> dict:
    """Collective under FSDP. The model's architecture, parameter shapes, and a fingerprint of its base weights
    (per tensor: sum and L2 norm accumulated in float64, over the full tensor on every world size). LoRA adapter
    tensors are left out: the base is what `--model` names."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    tensors = {}
    for name, param in inner.state_dict().items():
        if "lora_" in name:
            continue
        values = param.detach()
        # float64 accumulation without a float64 copy of the tensor (an embedding is GiBs)
        stats = [values.sum(dtype=torch.float64), torch.linalg.vector_norm(values, dtype=torch.float64)]
        stats = [float(x.full_tensor() if hasattr(x, "full_tensor") else x) for x in stats]  # DTensor: all ranks
        tensors[name] = [list(param.shape), *stats]
    return {"architectures": list(getattr(config, "architectures", None) or [type(inner).__name__]),
            "tensors": tensors}


def check_model_identity(path: Path, identity: dict, rel_tol: float = 1e-4) -> None:
    """The checkpoint's recorded model identity against --model's: architecture, parameter shapes, then the base
    weights' fingerprint (a relative tolerance absorbs the summation order of another world size)."""
    file = path / IDENTITY_FILE
    if not file.exists():
        import logging

        logging.getLogger("train").warning("checkpoint %s records no model identity (written by an older version): "
                                           "cannot check that --model is the model it was trained from", path)
        return
    try:
        saved = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointFileError(file, f"is not valid JSON ({exc})") from None
    fix = ("pass the --model this run was started with, or a fresh --output-dir without "
           "--resume-from-checkpoint to train this model from the start")
    if saved["architectures"] != identity["architectures"]:
        raise ValueError(f"checkpoint {path} was trained from a {saved['architectures']} model, --model is a "
                         f"{identity['architectures']}: {fix}")
    ours, theirs = identity["tensors"], saved["tensors"]
    shapes = [n for n in set(ours) | set(theirs) if n not in ours or n not in theirs or ours[n][0] != theirs[n][0]]
    if shapes:
        raise ValueError(f"checkpoint {path} holds parameters of other names or shapes than --model "
                         f"({len(shapes)}, e.g. {sorted(shapes)[:3]}): {fix}")
    differ = [n for n in ours if not all(math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-6)
                                         for a, b in zip(ours[n][1:], theirs[n][1:]))]
    if differ:
        raise ValueError(f"checkpoint {path} was trained from other base weights than --model (same architecture and "
                         f"shapes; {len(differ)} of {len(ours)} tensors differ at the run's start, e.g. "
                         f"{sorted(differ)[:3]}): {fix}")


def _full_state_dicts(model, optimizer):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=opts)


def save_checkpoint(output_dir: str | Path, step: int, model, tokenizer, optimizer, scheduler,
                    rollout_state: dict, save_total_limit: int | None = None) -> Path | None:
    """Collective: every rank calls it. Returns the final path on rank 0."""
    out = Path(output_dir)
    final, tmp = out / f"checkpoint-{step}", out / f"checkpoint-{step}.tmp"
    model_sd, optim_sd = _full_state_dicts(model, optimizer)  # collective under FSDP
    if _rank() == 0:
        for stale in out.glob("checkpoint-*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
        unwrap(model).save_pretrained(tmp, state_dict=model_sd, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(optim_sd, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        if (out / IDENTITY_FILE).exists():
            shutil.copy(out / IDENTITY_FILE, tmp / IDENTITY_FILE)
    _barrier()
    torch.save(_rng_state(), tmp / f"rng_rank{_rank()}.pt")
    _barrier()
    if _rank() != 0:
        return None
    (tmp / "rollout_state.json").write_text(json.dumps(rollout_state | {"step": step}))
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if save_total_limit:
        for old in list_checkpoints(out)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, scheduler and this rank's RNG; return rollout_state.json."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    path = Path(path)
    rollout_state = read_rollout_state(path)  # a truncated file is named before the weights load
    model_sd = {}
    for f in sorted(path.glob("*.safetensors")):
        model_sd |= load_file(f)
    model_sd = _to_model_names(model, model_sd, path)
    optim_sd = _safe_load(path / "optimizer.pt")
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False, strict=False)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=opts)
    scheduler.load_state_dict(_safe_load(path / "scheduler.pt"))
    rng = path / f"rng_rank{_rank()}.pt"
    if rng.exists():
        _set_rng_state(_safe_load(rng))
    return rollout_state


def unwrap(model):
    return getattr(model, "module", model)


def _to_model_names(model, state: dict, path: Path) -> dict:
    """save_pretrained reverts transformers' in-memory weight layout (e.g. fused MoE experts) to checkpoint names;
    when the names differ, load the checkpoint the way from_pretrained does and take its converted state."""
    names = set(unwrap(model).state_dict().keys())
    if set(state) <= names:
        return state
    adapter = getattr(unwrap(model), "active_adapter", None)
    if isinstance(adapter, str) and (path / "adapter_config.json").exists():
        # A PEFT checkpoint holds the adapter only, saved without the adapter name: `...q_proj.lora_A.weight` is
        # `...q_proj.lora_A.<adapter>.weight` in the model. The frozen base comes from `model` as loaded.
        renamed = {re.sub(r"\.(lora_[^.]+)\.", rf".\1.{adapter}.", k): v for k, v in state.items()}
        if set(renamed) <= names:
            return renamed
    from grpo.model import load_policy

    converted = load_policy(str(path), "float32", gradient_checkpointing=False).state_dict()
    missing = names - set(converted)
    if missing:
        raise KeyError(f"checkpoint {path} does not match the model ({len(missing)} weights missing, e.g. "
                       f"{sorted(missing)[:3]}); was it saved from a different architecture?")
    return converted


class CheckpointFileError(pickle.UnpicklingError):
    """A checkpoint file that cannot be read (truncated, corrupted, or holding more than tensors), by name."""

    def __init__(self, path: Path, problem: str):
        others = [p.name for p in list_checkpoints(path.parent.parent) if p != path.parent]
        super().__init__(f"checkpoint file {path} {problem}. Resume from another checkpoint "
                         f"({', '.join(others[-3:]) or 'none other in this output_dir'}: --resume-from-checkpoint "
                         f"<dir>), or move {path.parent} aside and pass --resume-from-checkpoint latest")


def _safe_load(path: Path):
    """Tensors and plain containers only (weights_only loading: no code runs); checkpoints of older versions stored
    numpy's RNG state as an ndarray, allowed by name. An unreadable file is named with the fix."""
    allowed = [np.ndarray, np.dtype, np.dtypes.UInt32DType, getattr(np, "_core", np).multiarray._reconstruct] \
        if hasattr(np, "dtypes") else []
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's text advises loading unsafely: not repeated
        raise CheckpointFileError(path, "holds objects other than tensors and plain containers (read with "
                                        "weights_only loading, nothing in it ran); it is corrupted or was not "
                                        "written by this trainer") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointFileError(path, f"cannot be read ({type(exc).__name__}: {str(exc)[:160]}); it is truncated "
                                        f"or corrupted (a disk full or a copy cut short?)") from None


def read_rollout_state(path: Path) -> dict:
    """rollout_state.json of a checkpoint directory, the file named when it is not JSON."""
    file = path / "rollout_state.json"
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointFileError(file, f"is not valid JSON ({exc}); it is truncated or corrupted") from None


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                    cached),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
