"""scripts/make_served_model.py: a public shape's widths on a small model directory's config and tokenizer (the
GPU end-to-end run serves and trains the Qwen3.5-2B shape this way)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import make_served_model  # noqa: E402
from bench_step import SHAPES  # noqa: E402


# other widths than the tiny model's, so that a graft that did nothing fails
WIDE = ("qwen3_5", dict(vocab_size=1024, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=48, linear_num_key_heads=2,
                        linear_num_value_heads=2, linear_key_head_dim=24, linear_value_head_dim=24,
                        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
                        tie_word_embeddings=True))


def test_grafted_model_loads_with_the_shapes_widths_and_the_small_models_tokens(tiny_models, tmp_path, monkeypatch):
    import transformers as tf

    monkeypatch.setitem(SHAPES, "graft-test", WIDE)
    like = tiny_models["qwen3_5"]
    assert tf.AutoConfig.from_pretrained(like).text_config.hidden_size != WIDE[1]["hidden_size"]
    out = make_served_model.make("graft-test", tmp_path / "m", like, device="cpu")
    model = tf.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.bfloat16)
    text, small = model.config.text_config, tf.AutoConfig.from_pretrained(like)
    for key, value in WIDE[1].items():
        got = getattr(text, key) if key != "tie_word_embeddings" else model.config.tie_word_embeddings
        assert (list(got) if isinstance(value, list) else got) == value, key
    assert model.config.vision_config.out_hidden_size == text.hidden_size
    assert (text.eos_token_id, model.config.image_token_id) == (small.text_config.eos_token_id, small.image_token_id)
    assert model.model.language_model.embed_tokens.weight.shape == (text.vocab_size, text.hidden_size)
    tok, small_tok = tf.AutoTokenizer.from_pretrained(out), tf.AutoTokenizer.from_pretrained(like)
    assert tok("hello world")["input_ids"] == small_tok("hello world")["input_ids"]
    assert tok.chat_template == small_tok.chat_template and (out / "generation_config.json").exists()
