"""A tiny Qwen3 with seeded random weights and a byte-level tokenizer, so nvchat runs with no
download. Its replies are gibberish: it exists to exercise the whole stack, not to answer.

It is written once to a cache directory and then loaded like any other checkpoint.
"""
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engine.options import default_cache_dir

DEMO_VERSION = 2

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]

# ChatML, with Qwen3's enable_thinking switch: when thinking is off the template closes an
# empty think block for the model.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

DEMO_SHAPE = dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=32768)


def _byte_alphabet() -> list[str]:
    """One printable character per byte value, as byte-level BPE tokenizers use: printable
    Latin-1 bytes stand for themselves, the rest are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, shift = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + shift)
            shift += 1
    return [chars[b] for b in range(256)]


def _save_tokenizer(out: Path) -> int:
    # start-up: only the first run on a cache directory builds the demo model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(_byte_alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    fast.add_tokens(THINK_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(fast)


def _save_model(out: Path, vocab_size: int, eos_ids: list[int]) -> None:
    from safetensors.torch import save_file  # start-up: as above, only to build it

    shape = DEMO_SHAPE
    config = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=vocab_size,
                  rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=False, attention_bias=False,
                  hidden_act="silu", torch_dtype="float32", eos_token_id=eos_ids[0], bos_token_id=None, **shape)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}, indent=2))

    g = torch.Generator().manual_seed(20261122)
    h, inter, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d

    def rand(*size, std=0.08):
        return torch.randn(*size, generator=g) * std

    # Untied head that only ever favours printable ASCII and the end of turn, so the gibberish at
    # least streams as readable characters and replies end now and then.
    lm_head = torch.zeros(vocab_size, h)
    printable = list(range(ord(" "), ord("~") + 1)) + [ord("\n")] + eos_ids[:1]
    lm_head[printable] = rand(len(printable), h, std=0.3)
    weights = {"model.embed_tokens.weight": rand(vocab_size, h, std=0.5), "model.norm.weight": torch.ones(h),
               "lm_head.weight": lm_head}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": rand(q, h), p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, q),
            p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        })
    save_file(weights, str(out / "model.safetensors"))


def ensure_demo_model(cache_dir: Path | None = None) -> Path:
    """Path of the demo checkpoint, writing it on first use (atomically, so two processes
    starting together both end up with a whole one)."""
    target = (cache_dir or default_cache_dir()) / f"demo-qwen3-v{DEMO_VERSION}"
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        vocab_size = _save_tokenizer(tmp)
        from transformers import AutoTokenizer  # start-up: as above, only to build it
        tok = AutoTokenizer.from_pretrained(tmp)
        eos = [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
        _save_model(tmp, vocab_size, eos)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
