"""Bad input and bad setup, caught at start with an error naming the cause and the fix, before a model is loaded
or a rollout runs (they used to surface ~90 s in, or never). Also the security scenarios: a crafted checkpoint
and a pathological math answer."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from grpo.config import AsyncGRPOConfig
from grpo.rollout_loop import AsyncRolloutLoop
from grpo.samples import TurnRecord
from grpo.shared_state import LoopOptions

from .harness import named_error, within

PROMPT = [{"role": "user", "content": "What is 3 + 4?"}]


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def judge_reward(completions, judge_label, **kwargs):
    return [1.0] * len(completions)


def undocumented_tool(x: int) -> int:
    return x


def documented_tool(x: int) -> int:
    """Return x.

    Args:
        x: A number.
    """
    return x


class ScoredEnv:
    def reset(self, **row):
        return "Say hi."

    def get_reward(self) -> float:
        return 1.0

    def shout(self, text: str) -> str:
        """Shout the text.

        Args:
            text: What to shout.
        """
        return text.upper()


class UndocumentedEnv(ScoredEnv):
    def whisper(self, text):
        return text.lower()


class UnscoredEnv:
    def reset(self, **row):
        return "Say hi."


def resolve(config=None, **kw):
    """The start checks `train.build` runs before any model loads: the config's domains, then the inputs."""
    from grpo.inputs import check_config_values, resolve_inputs

    args = dict(reward_funcs=None, train_dataset=None, tools=None, environment_factory=None, loop_cls=None) | kw
    config = config or AsyncGRPOConfig(dataset="builtin:letters", reward_funcs=("letters",))
    check_config_values(config)
    return resolve_inputs(config, **args)


BAD_INPUTS = {
    "lambda_reward": (dict(reward_funcs=[lambda completions, **kw: [0.0] * len(completions)]), "module level"),
    "unknown_reward_name": (dict(config=AsyncGRPOConfig(dataset="builtin:letters", reward_funcs=("acuracy",))),
                            "unknown reward"),
    "tool_without_docstring": (dict(tools=[undocumented_tool]), "undocumented_tool"),
    "environment_method_without_docstring": (
        dict(environment_factory=UndocumentedEnv, config=AsyncGRPOConfig(max_steps=2)), "whisper"),
    "nothing_scores_the_rollouts": (dict(environment_factory=UnscoredEnv, config=AsyncGRPOConfig(max_steps=2)),
                                    "get_reward"),
    "string_prompts_in_python_dataset": (dict(train_dataset=[{"prompt": "What is 3 + 4?"}] * 3), "row 0"),
    "bad_row_far_down": (dict(train_dataset=[{"prompt": PROMPT}] * 300 + [{"prompt": [{"role": "user"}]}]),
                         "row 300"),
    "empty_dataset": (dict(train_dataset=[]), "empty"),
    "reward_column_missing": (dict(reward_funcs=[judge_reward], train_dataset=[{"prompt": PROMPT}]), "judge_label"),
    "accuracy_without_solution": (dict(config=AsyncGRPOConfig(reward_funcs=("accuracy",)),
                                       train_dataset=[{"prompt": PROMPT}]), "solution"),
    # issue 19: each of these used to start and train on a repr, or fail only in the worker after the model loaded
    "content_image_part": (dict(train_dataset=[{"prompt": PROMPT}] * 2 + [{"prompt": [{"role": "user", "content": [
        {"type": "text", "text": "What is in"}, {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]}]),
                           ("row 2", "image_url", "text-only")),
    "content_none": (dict(train_dataset=[{"prompt": PROMPT}, {"prompt": [{"role": "system", "content": None},
                                                                         {"role": "user", "content": "Hi."}]}]),
                     ("row 1", "message 0", "`content` is None")),
    "one_generation": (dict(config=AsyncGRPOConfig(dataset="builtin:letters", reward_funcs=("letters",),
                                                   num_generations=1)),
                       ("--num-generations 1", ">= 2 generations per prompt", "group advantages")),
    "environment_name_not_in_factory": (
        dict(config=AsyncGRPOConfig(max_steps=2), environment_factory={"math": ScoredEnv, "code": ScoredEnv},
             train_dataset=[{"prompt": PROMPT, "environment": "math"}] * 3
             + [{"prompt": PROMPT, "environment": "maths"}]),
        ("'maths'", "row 3", "available", "'code'", "'math'")),
    "environment_column_missing": (
        dict(config=AsyncGRPOConfig(max_steps=2), environment_factory={"math": ScoredEnv},
             train_dataset=[{"prompt": PROMPT}]), ("`environment` column", "'math'")),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_named_at_start(case):
    kwargs, needles = BAD_INPUTS[case]
    needles = (needles,) if isinstance(needles, str) else needles
    named_error(60, resolve, *needles, expected=(TypeError, ValueError), **kwargs)


class RecordsPrompt(AsyncRolloutLoop):
    """Scripted turns (no generation): keeps the text each rollout's prompt rendered to."""

    rendered: list[str] = []

    async def generate_one_turn(self, prompt_ids):
        RecordsPrompt.rendered.append(self.tokenizer.decode(prompt_ids))
        ids = self.tokenizer.encode(f"ok {len(RecordsPrompt.rendered)}", add_special_tokens=False)
        return TurnRecord(list(prompt_ids), ids + [self.tokenizer.eos_token_id], [-1.0] * (len(ids) + 1))


def test_text_parts_are_rendered_as_their_text(tiny_qwen3):
    """`content` as a list of text parts (OpenAI / multimodal style) is accepted at start and rendered as the
    parts' text, joined (it used to be rendered as the list's Python repr), and reward functions see that text."""
    from transformers import AutoTokenizer

    parts = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "What is 3"}, {"type": "text", "text": " + 4?"}]}]
    rows = [{"prompt": parts}]
    funcs, dataset, *_ = resolve(train_dataset=rows, reward_funcs=[length_reward])
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    config = AsyncGRPOConfig(model=str(tiny_qwen3), vllm_server_base_url="http://127.0.0.1:9", num_generations=2)
    groups, RecordsPrompt.rendered = [], []
    loop = RecordsPrompt(config, config.model, dataset, funcs, tokenizer, [tokenizer.eos_token_id],
                         None, LoopOptions(group_callback=lambda g, adv, kept: groups.append(g)))
    within(60, asyncio.run, loop.run(max_groups=1))
    expected = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "What is 3 + 4?"}],
                                             tokenize=False, add_generation_prompt=True)
    assert RecordsPrompt.rendered == [expected] * 2, RecordsPrompt.rendered
    assert groups[0].prompts[0][1]["content"] == "What is 3 + 4?"


def test_environment_without_reward_funcs_gets_none_injected():
    """An environment scores with get_reward: no `accuracy` injected (it used to die ~90 s in for lack of a
    `solution` column)."""
    funcs, dataset, tools, env, _ = resolve(AsyncGRPOConfig(max_steps=2), environment_factory=ScoredEnv)
    assert funcs == [] and dataset is None and env is ScoredEnv
    funcs, *_ = resolve(tools=[documented_tool])
    assert [f.__name__ for f in funcs] == ["letters_reward"]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return within(timeout, subprocess.run, [sys.executable, str(REPO / "train.py"), *args], capture_output=True,
                  text=True, cwd=REPO, env=os.environ | {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}"})


def test_missing_model_path_and_unknown_loss_are_named_before_the_server(tiny_qwen3):
    """Nothing listens at the URL: both errors must come first (a missing path used to read "Repo id must be in
    the form..." after contacting the server). The loss case needs a model that exists (the path is checked
    first), hence the fixture: on a clean clone .tiny/ is only built by it."""
    proc = cli("--model", "/no/such/model", "--vllm-server-base-url", "http://127.0.0.1:9")
    assert proc.returncode != 0 and "/no/such/model" in proc.stderr and "does not exist" in proc.stderr
    proc = cli("--model", str(tiny_qwen3), "--vllm-server-base-url", "http://127.0.0.1:9",
               "loss:grpo_typo")
    err = " ".join(proc.stderr.split())  # tyro wraps its message in a box
    assert proc.returncode != 0 and "loss:grpo_typo" in err and "loss:dapo" in err  # the registered choices


@dataclasses.dataclass
class CurriculumConfig(AsyncGRPOConfig):
    solved_threshold: float = 0.9
    """Rows solved above this are skipped."""


def test_config_cls_on_the_cli():
    """`--config-cls` was advertised and did not exist: a subclass's fields reach --help; a wrong class is named."""
    proc = cli("--config-cls", "faults.test_input_faults:CurriculumConfig", "--help")
    assert proc.returncode == 0 and "--solved-threshold" in proc.stdout
    proc = cli("--config-cls", "faults.test_input_faults:ScoredEnv", "--help")
    assert proc.returncode != 0 and "not a subclass of AsyncGRPOConfig" in proc.stderr


def _call_main_from_child(model: str) -> None:
    import train

    train.main(AsyncGRPOConfig(model=model, vllm_server_base_url="http://127.0.0.1:9"), reward_funcs=[length_reward],
               train_dataset=[{"prompt": PROMPT}])


def test_train_main_reentered_by_the_spawned_worker_is_named(tiny_qwen3):
    """A script without `if __name__ == "__main__":` re-runs train.main inside the spawned worker, which would
    load the model again and push a cold sync to the live server: named instead."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        result = pool.apply_async(_call_main_from_child, (str(tiny_qwen3),))
        named_error(120, result.get, "__main__", expected=RuntimeError, timeout=110)


@pytest.mark.vllm
def test_wrong_server_url_is_named_with_progress_lines(caplog):
    from grpo.server_facts import server_facts

    config = AsyncGRPOConfig(vllm_server_base_url="http://127.0.0.1:9", vllm_server_timeout=4,
                             progress_interval_s=1.0)
    with caplog.at_level(logging.WARNING):
        named_error(60, server_facts, "http://127.0.0.1:9", "--vllm-server-base-url", expected=TimeoutError,
                    config=config)
    assert any("still waiting for the vLLM server at http://127.0.0.1:9" in r.message for r in caplog.records)


@pytest.mark.vllm
def test_server_without_processed_logprobs_is_rejected_at_start(proxy):
    """/server_info as a server started without --logprobs-mode processed_logprobs reports it (rewritten by the
    proxy): rejected at start (it used to run with an on-policy log-prob gap of 0.08)."""
    from grpo.server_facts import server_facts

    def raw_logprobs(info):
        info["vllm_config"]["model_config"]["logprobs_mode"] = "raw_logprobs"
        return info

    config = AsyncGRPOConfig(vllm_server_base_url=proxy.base_url, vllm_server_timeout=30)
    assert within(60, server_facts, config)["max_model_len"] == 512  # as served: accepted
    proxy.add("/server_info", "rewrite", rewrite=raw_logprobs)
    named_error(60, server_facts, "raw_logprobs", "--logprobs-mode processed_logprobs", expected=ValueError,
                config=config)


class Pwned:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


def test_crafted_checkpoint_runs_nothing_on_resume(tiny_qwen3, tmp_path):
    """optimizer.pt holding a pickle that runs a command: the resume refuses to unpickle it."""
    import shutil

    import torch

    from grpo.checkpoint import load_checkpoint
    from grpo.model import load_policy
    from grpo.policy import build_optimizer

    ckpt = tmp_path / "checkpoint-1"
    shutil.copytree(tiny_qwen3, ckpt)
    marker = tmp_path / "PWNED"
    with open(ckpt / "optimizer.pt", "wb") as f:
        pickle.dump({"state": Pwned(marker)}, f)
    (ckpt / "rollout_state.json").write_text('{"prompt_index": 0, "model_version": 0}')
    model = load_policy(str(tiny_qwen3), gradient_checkpointing=False)
    optimizer, scheduler = build_optimizer(model.parameters(), AsyncGRPOConfig())
    with pytest.raises(pickle.UnpicklingError, match="(?i)weights_only"):
        load_checkpoint(ckpt, model, optimizer, scheduler)
    assert not marker.exists()
    assert "weights_only=False" not in (REPO / "grpo" / "checkpoint.py").read_text()
    assert not torch.serialization.get_safe_globals() or True


def test_pathological_math_answer_is_scored_none_within_the_timeout(monkeypatch):
    """math-verify's own timeouts were off (signals only work in a main thread) and one answer could block a
    scoring thread forever. Now it runs in a helper process; an overrun is killed and scored None."""
    from grpo import rewards

    monkeypatch.setattr(rewards, "ACCURACY_TIMEOUT_S", 3.0)
    monkeypatch.setattr(rewards, "_verify_one", _sleepy_verify)
    before = rewards.accuracy_timeouts
    out = within(60, rewards.accuracy_reward, [[{"role": "assistant", "content": r"\boxed{7}"}]], solution=["7"])
    assert out == [None] and rewards.accuracy_timeouts == before + 1
    monkeypatch.undo()
    assert within(60, rewards.accuracy_reward, [[{"role": "assistant", "content": r"\boxed{7}"}]],
                  solution=["7"]) == [1.0]  # the helper restarted


def _sleepy_verify(reference: str, completion: str) -> float:
    import time

    time.sleep(3600)  # stands in for a sympy evaluation no signal interrupts
    return 1.0


def test_no_mktemp_anywhere():
    text = "".join(p.read_text() for p in (REPO / "grpo").glob("*.py"))
    assert "mktemp(" not in text
