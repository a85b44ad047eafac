"""Start-up checks of what a run is given: a vLLM server really behind the URL, a tokenizer with a chat template,
a map-style dataset, an output_dir no live run holds, a checkpoint of the same model, checkpoint files readable
or named. Each fails at start with a named error and its fix."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from grpo.config import AsyncGRPOConfig

PROMPT = [{"role": "user", "content": "hi"}]


# ---- the server behind --vllm-server-base-url -------------------------------------------------------------------
@pytest.fixture
def plain_http_server(tmp_path):
    """A web server that is not vLLM (python -m http.server): /health is a 404."""
    handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **kw)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_a_non_vllm_http_server_is_identified_and_refused(plain_http_server):
    from grpo.server_facts import server_facts
    from grpo.vllm_client import NotVLLMServerError

    start = time.monotonic()
    config = AsyncGRPOConfig(vllm_server_base_url=plain_http_server + "/v1", vllm_server_timeout=60)
    with pytest.raises(NotVLLMServerError, match="not a vLLM server.*404.*--vllm-server-base-url"):
        server_facts(config)
    assert time.monotonic() - start < 10


@pytest.mark.vllm
def test_the_openai_style_url_reaches_the_real_server(vllm_server, tiny_qwen3):
    from grpo.server_facts import server_facts

    facts = server_facts(AsyncGRPOConfig(model=str(tiny_qwen3), vllm_server_base_url=vllm_server.base_url + "/v1"))
    assert facts["max_model_len"] > 0


# ---- tokenizer and dataset --------------------------------------------------------------------------------------
def test_a_tokenizer_without_a_chat_template_is_refused_by_name():
    from grpo.inputs import check_tokenizer

    with pytest.raises(ValueError, match="no chat template.*chat_template"):
        check_tokenizer(types.SimpleNamespace(chat_template=None), "base/model")
    check_tokenizer(types.SimpleNamespace(chat_template="{{ messages }}"), "chat/model")


def test_a_dataframe_is_refused_naming_from_pandas():
    import pandas as pd

    from grpo.data import validate_prompts

    with pytest.raises(ValueError, match=r"DataFrame.*datasets\.Dataset\.from_pandas"):
        validate_prompts(pd.DataFrame({"prompt": [PROMPT]}), "train_dataset")


def test_a_streaming_dataset_is_refused_with_the_reason():
    import datasets

    from grpo.data import validate_prompts

    stream = datasets.Dataset.from_list([{"prompt": PROMPT}] * 3).to_iterable_dataset()
    with pytest.raises(ValueError, match="IterableDataset.*cannot be repositioned.*Dataset.from_list"):
        validate_prompts(stream, "train_dataset")
    validate_prompts(datasets.Dataset.from_list([{"prompt": PROMPT}] * 3), "train_dataset")  # map-style passes


# ---- the output_dir lock ----------------------------------------------------------------------------------------
def write_lock(out, pid: int, host: str | None = None):
    from grpo.run_lock import LOCK_NAME

    out.mkdir(parents=True, exist_ok=True)
    (out / LOCK_NAME).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "start": "then"}))


def test_an_output_dir_held_by_a_live_run_is_refused_naming_it(tmp_path, caplog):
    from grpo import run_lock

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, other.pid)
        with pytest.raises(run_lock.OutputDirInUseError, match=f"pid {other.pid} on {socket.gethostname()}.*then"):
            run_lock.acquire(tmp_path)
    finally:
        other.kill()
        other.wait()
    with caplog.at_level("WARNING", logger="train"):
        lock = run_lock.acquire(tmp_path)  # the holder is gone: taken over, said so
    assert "taking over" in caplog.text and str(other.pid) in caplog.text
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    run_lock.release(lock)
    assert not lock.exists()


def test_a_lock_from_another_host_is_refused(tmp_path):
    from grpo import run_lock

    write_lock(tmp_path, 1, host="elsewhere.example")
    with pytest.raises(run_lock.OutputDirInUseError, match="elsewhere.example.*another host.*delete"):
        run_lock.acquire(tmp_path)


# ---- checkpoints ------------------------------------------------------------------------------------------------
def test_a_truncated_rollout_state_is_named(tmp_path):
    from grpo.checkpoint import CheckpointFileError, load_checkpoint

    ckpt = tmp_path / "checkpoint-4"
    ckpt.mkdir()
    (ckpt / "rollout_state.json").write_text('{"prompt_index": 12, "model_ver')
    with pytest.raises(CheckpointFileError, match="checkpoint-4/rollout_state.json.*not valid JSON.*another"):
        load_checkpoint(ckpt, None, None, None)  # read first: nothing else is touched


def test_a_corrupted_optimizer_file_is_named_without_unsafe_advice(tmp_path):
    from grpo.checkpoint import CheckpointFileError, _safe_load

    for i, damage in enumerate((lambda b: b[: len(b) // 2], lambda b: b"\x00garbage" + b[8:])):
        ckpt = tmp_path / f"checkpoint-{i}"
        ckpt.mkdir()
        torch.save({"state": {0: {"exp_avg": torch.ones(64)}}}, ckpt / "optimizer.pt")
        (ckpt / "optimizer.pt").write_bytes(damage((ckpt / "optimizer.pt").read_bytes()))
        with pytest.raises(CheckpointFileError) as info:
            _safe_load(ckpt / "optimizer.pt")
        text = str(info.value)
        assert "optimizer.pt" in text and "--resume-from-checkpoint" in text and "weights_only=False" not in text


class Net(torch.nn.Module):
    def __init__(self, width: int = 4, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.body, self.head = torch.nn.Linear(width, width), torch.nn.Linear(width, 2)


def test_a_resume_checks_the_model_identity(tmp_path):
    from grpo.checkpoint import IDENTITY_FILE, check_model_identity, model_identity

    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    (ckpt / IDENTITY_FILE).write_text(json.dumps(model_identity(Net(seed=0))))
    check_model_identity(ckpt, model_identity(Net(seed=0)))  # the same base weights
    with pytest.raises(ValueError, match="other base weights than --model.*--model this run was started with"):
        check_model_identity(ckpt, model_identity(Net(seed=1)))  # same shapes, other weights
    with pytest.raises(ValueError, match="other names or shapes"):
        check_model_identity(ckpt, model_identity(Net(width=8)))
