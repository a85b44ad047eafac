"""grpo/data.py (local files, built-in tasks, validation) and grpo/rewards.py (hand-written cases, learnability)."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from grpo.data import builtin_dataset, load_prompts, message_text, text_messages, validate_prompts
from grpo.rewards import REWARDS, accuracy_reward, format_reward, letters_reward, resolve_reward

ROWS = [
    {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "solution": "5", "difficulty": 1},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Solve x^2 = 4, x > 0."}],
     "solution": "2", "difficulty": 3},
]


def assistant(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


@pytest.mark.parametrize("suffix", ["jsonl", "json", "parquet"])
def test_local_files_keep_prompts_and_extra_columns(tmp_path, suffix):
    import datasets

    path = tmp_path / f"prompts.{suffix}"
    if suffix == "parquet":
        datasets.Dataset.from_list(ROWS).to_parquet(str(path))
    elif suffix == "json":
        path.write_text(json.dumps(ROWS))
    else:
        path.write_text("\n".join(json.dumps(row) for row in ROWS))
    dataset = load_prompts(str(path), split="train")
    assert len(dataset) == 2 and set(dataset.column_names) == {"prompt", "solution", "difficulty"}
    assert [row["prompt"] for row in dataset] == [row["prompt"] for row in ROWS]
    assert dataset["solution"] == ["5", "2"] and dataset["difficulty"] == [1, 3]


def test_plain_string_prompt_error_names_the_fix(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2 + 3?", "solution": "5"}) + "\n")
    with pytest.raises(ValueError, match=r"plain string.*'role': 'user', 'content'"):
        load_prompts(str(path))


def test_missing_prompt_column_and_bad_messages(tmp_path):
    path = tmp_path / "question.jsonl"
    path.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(ValueError, match="rename_column"):
        load_prompts(str(path))
    assert load_prompts(str(path), require_prompt=False).column_names == ["question"]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": [{"text": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="`role` and `content`"):
        load_prompts(str(path))
    (tmp_path / "prompts.txt").write_text("What is 2 + 3?\n")
    with pytest.raises(ValueError, match="unsupported dataset file"):
        load_prompts(str(tmp_path / "prompts.txt"))


def test_message_content_text_parts_none_and_non_text():
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "image": None}]}
    assert message_text(parts) == "ab"  # joined with nothing between, as multimodal templates render them
    plain = {"role": "user", "content": "x"}
    call = {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f"}}]}
    out = text_messages([plain, parts, call])
    assert out[0] is plain and out[1]["content"] == "ab" and out[2] is call and parts["content"][0]["text"] == "a"
    validate_prompts([{"prompt": [plain, parts, call]}])  # all three are fine at start
    with pytest.raises(ValueError, match=r"rows row 0, message 1 \(role 'user'\): `content` is None"):
        validate_prompts([{"prompt": [plain, {"role": "user", "content": None}]}], "rows")
    with pytest.raises(ValueError, match=r"row 1, message 0: content part 1 has type 'image'; this trainer is text"):
        validate_prompts([{"prompt": [plain]}, {"prompt": [{"role": "user", "content": [
            {"type": "text", "text": "see"}, {"type": "image", "image": "cat.png"}]}]}])
    with pytest.raises(ValueError, match="must be a string or a list of text parts, got int"):
        message_text({"role": "user", "content": 3})


def test_builtin_task_dataset_and_registry_reward_pair():
    dataset = load_prompts("builtin:letters")
    assert len(dataset) >= 100 and "task" in dataset[0]
    assert len({row["prompt"][0]["content"] for row in dataset}) > 50  # distinct prompts
    assert resolve_reward("letters") is letters_reward
    with pytest.raises(ValueError, match="builtin:letters"):
        builtin_dataset("nope")


def test_letters_heldout_split_shares_no_prompt_with_the_training_rows():
    train = {row["prompt"][0]["content"] for row in load_prompts("builtin:letters")}
    held_out = [row["prompt"][0]["content"] for row in load_prompts("builtin:letters_heldout")]
    assert len(held_out) >= 100 and len(set(held_out)) == len(held_out)
    assert not train & set(held_out)
    assert all(row["task"] == "letters" for row in load_prompts("builtin:letters_heldout"))


def test_resolve_reward_by_name_and_import_path():
    assert resolve_reward("accuracy") is accuracy_reward and resolve_reward("format") is format_reward
    assert resolve_reward("grpo.rewards:letters_reward") is letters_reward
    for bad in ("nope", "grpo.rewards:nope", "no_such_module_xyz:f"):
        with pytest.raises(ValueError):
            resolve_reward(bad)
    for func in REWARDS.values():  # the rollout worker receives them pickled
        assert pickle.loads(pickle.dumps(func)) is func


def test_accuracy_reward_hand_written_cases():
    completions = [
        assistant(r"Adding gives \boxed{5}."),
        assistant(r"First 4, then \boxed{6}."),
        assistant("The answer is 5."),
        assistant(r"\boxed{\frac{1}{2}}"),
        assistant("I am not sure."),
        assistant(r"x = \boxed{2}"),
    ]
    solution = ["5", "5", "5", "0.5", "5", "$\\sqrt{4}$"]
    assert accuracy_reward(completions, solution=solution) == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    assert accuracy_reward([assistant(r"\boxed{3}")], answer=["3"]) == [1.0]
    assert accuracy_reward([assistant(r"\boxed{3}")], solution=["\\unparsable{"]) in ([None], [0.0])
    with pytest.raises(ValueError, match="solution"):
        accuracy_reward([assistant("1")])


def test_accuracy_reward_works_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        result = pool.submit(accuracy_reward, [assistant(r"\boxed{12}")], solution=["12"]).result(timeout=60)
    assert result == [1.0]


def test_format_reward_hand_written_cases():
    completions = [
        assistant("<think>1 + 2 = 3, times 4</think><answer>12</answer>"),
        assistant("<think>\nmulti\nline\n</think>\n<answer>8</answer>\n"),
        assistant("So (3 + 1) * 2 = 8."),
        assistant("<answer>8</answer><think>late</think>"),
    ]
    assert format_reward(completions) == [1.0, 1.0, 0.0, 0.0]


def test_letters_reward_hand_written_cases():
    completions = [assistant("the cat"), assistant("a1 b2"), assistant("123"), assistant(""), assistant("   "),
                   assistant("héllo")]
    assert letters_reward(completions) == [1.0, 0.5, 0.0, 0.0, 0.0, 0.8]


def sample(model, prompt_ids: torch.Tensor, num_tokens: int, generator: torch.Generator) -> torch.Tensor:
    """Ancestral sampling at T = 1 (no KV cache: the tiny model makes full forwards cheap)."""
    ids = prompt_ids  # [G, P]
    with torch.no_grad():
        for _ in range(num_tokens):
            probs = torch.softmax(model(ids).logits[:, -1].double(), dim=-1)  # [G, V]
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids  # [G, P + T]


@pytest.mark.slow
def test_letters_task_is_learnable_by_the_tiny_random_model(tiny_qwen3):
    """GRPO's signal on builtin:letters: a REINFORCE loop with group-normalised advantages (no clipping, no
    server) lifts the tiny random model's mean reward well above its starting point within 50 steps at lr 1e-3."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    row = builtin_dataset("letters")[0]
    text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    group, num_tokens = 16, 12
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    generator = torch.Generator().manual_seed(0)
    means = []
    for _ in range(50):
        sequences = sample(model, torch.tensor([prompt] * group), num_tokens, generator)  # [G, P + T]
        completion_ids = sequences[:, len(prompt):]  # [G, T]
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids.tolist()]
        rewards = torch.tensor(letters_reward([assistant(t) for t in texts]))  # [G]
        means.append(rewards.mean().item())
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # [G]
        logits = model(sequences).logits[:, len(prompt) - 1:-1]  # [G, T, V]
        policy_logprobs = torch.log_softmax(logits, -1).gather(-1, completion_ids[..., None])[..., 0]  # [G, T]
        loss = -(advantages[:, None] * policy_logprobs).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    start, end = sum(means[:3]) / 3, sum(means[-3:]) / 3
    assert 0.02 < start < 0.35, means  # graded from the start: not all-zero groups
    assert end > start + 0.2, means
