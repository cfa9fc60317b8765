"""Tiny GGUF files written with the `gguf` package from tiny save_pretrained models, laid out as
llama.cpp's converter lays them out (llama q/k rows permuted for its RoPE), in a mix of tensor
types, with a tokenizer and chat template in the metadata: a byte-level BPE one with ChatML (as
Qwen and SmolLM2 files have), or a SentencePiece one (`tokenizer.ggml.model = "llama"`, as
Llama-2, TinyLlama and Mistral files have) with a Mistral-style template."""
import numpy as np

from tests.conftest import hf_greedy, save_tiny_hf_model

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "a n"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Row lengths of 256 so that the k-quants (blocks of 256) fit.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.05)


def tokenizer_tokens(tokenizer: str = "gpt2") -> list[str]:
    if tokenizer == "llama":
        return [token for token, _, _ in spm_vocabulary()]
    from engine.checkpoints.demo_model import _byte_alphabet
    return _byte_alphabet() + [m.replace(" ", "") for m in MERGES] + SPECIALS


# A SentencePiece vocabulary laid out as llama.cpp's converter writes Llama-2's: <unk>, <s>, </s>,
# the 256 byte-fallback tokens <0x00>..<0xFF>, then the pieces, best first, "▁" standing for a
# space. There are no merges in such a file: readers rebuild them from the pieces and their
# scores. Characters with no piece (newlines, CJK, emoji, most capitals) are spelled in bytes.
SPM_CHARS = "▁etaoinshrdlucmwyfgpbkv,.!?'HIW[]/é"
SPM_PIECES = ["▁t", "he", "▁the", "in", "▁in", "▁a", "an", "er", "on", "▁w", "or", "▁wor", "ld", "▁world",
              "▁H", "el", "ll", "▁He", "▁Hel", "▁Hell", "▁Hello", "is", "▁is", "▁▁", "▁▁▁▁", "ca", "▁ca",
              "fé", "▁café", "at", "▁at", "▁I", "it", "▁it", "st", "▁st", "re", "▁re", "ou", "▁y", "▁you"]
SPM_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ '[SYS] ' + m['content'] + ' [/SYS]\n' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}{% endfor %}")


def spm_vocabulary() -> list[tuple[str, float, int]]:
    """(piece, score, gguf.TokenType) for each token of the SentencePiece vocabulary."""
    from gguf import TokenType
    vocab = [("<unk>", 0.0, TokenType.UNKNOWN), ("<s>", 0.0, TokenType.CONTROL), ("</s>", 0.0, TokenType.CONTROL)]
    vocab += [(f"<0x{b:02X}>", 0.0, TokenType.BYTE) for b in range(256)]
    # Longer pieces score lower than the characters they are made of, as a trained model's do.
    pieces = list(SPM_CHARS) + SPM_PIECES
    vocab += [(piece, -float(i), TokenType.NORMAL) for i, piece in enumerate(pieces)]
    return vocab


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to llama q/k rows (pairs for GPT-J-style RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_K_QUANT_SCALES = {"Q2_K": slice(-4, None), "Q3_K": slice(-2, None), "Q4_K": slice(0, 4),
                   "Q5_K": slice(0, 4), "Q6_K": slice(-2, None)}


def _k_quant_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """gguf can't quantize to the k-quants, only read them: random block bytes with small f16
    super-block scales (d, and dmin where the type has one) make a valid tensor of that type."""
    import gguf
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_size, type_size), dtype=np.uint8)
    where = _K_QUANT_SCALES[qtype.name]
    n = len(range(type_size)[where]) // 2
    blocks[..., where] = np.tile(np.array([0.002], dtype=np.float16).view(np.uint8), n)
    return blocks.reshape(rows, -1)


def _types(layer: int):
    """Tensor type per block tensor: between the two layers, every supported type."""
    from gguf import GGMLQuantizationType as T
    if layer == 0:
        return {"attn_q": T.Q4_0, "attn_k": T.Q4_1, "attn_v": T.Q5_0, "attn_output": T.Q5_1,
                "ffn_gate": T.Q4_K, "ffn_up": T.Q6_K, "ffn_down": T.BF16}
    return {"attn_q": T.Q2_K, "attn_k": T.Q3_K, "attn_v": T.Q5_K, "attn_output": T.Q8_0,
            "ffn_gate": T.F16, "ffn_up": T.Q4_K, "ffn_down": T.Q6_K}


# A mixture-of-experts layer's stacked experts, [experts, rows, columns], as llama.cpp's
# converter writes them: gate and up apart (HF holds them as one gate_up tensor).
_EXPERT_TYPES = {"ffn_gate_exps": "Q8_0", "ffn_up_exps": "F16", "ffn_down_exps": "Q4_0"}


def write_tiny_gguf(path, *, arch: str = "llama", tie: bool = False, seed: int = 0, quantized: bool = True,
                    tokenizer: str = "gpt2"):
    """Writes path (a .gguf file) from a tiny random HF model of the given architecture (llama,
    qwen2, qwen3 or qwen3_moe), with a byte-level BPE tokenizer (tokenizer="gpt2") or a
    SentencePiece one ("llama")."""
    import gguf
    from gguf import GGMLQuantizationType as T

    shape = dict(SHAPE, vocab_size=len(tokenizer_tokens(tokenizer)))
    if arch in ("qwen3", "qwen3_moe"):
        shape["head_dim"] = 128  # what HF assumes for a qwen3 GGUF (it ignores key_length)
    if arch == "qwen3_moe":
        # HF reads no expert_feed_forward_length from a qwen3moe file: it takes Qwen3MoeConfig's
        # default of 768, so the experts here have that many columns.
        shape.update(moe_intermediate_size=768, num_experts=4)
    model = save_tiny_hf_model(path.parent / f"{path.stem}-hf", tie=tie, arch=arch, seed=seed, **shape)
    c = model.config
    rng = np.random.default_rng(seed)

    w = gguf.GGUFWriter(str(path), arch.replace("_", ""))
    _add_metadata(w, arch, c, tokenizer)

    for name, tensor in _split_experts(model.state_dict()):
        if name.endswith("_exps.weight"):
            qtype = T[_EXPERT_TYPES[name.split(".")[-2]]] if quantized else T.F32
            t = tensor.float().numpy()
            data = t.astype(np.float16) if qtype == T.F16 else t if qtype == T.F32 else gguf.quants.quantize(t, qtype)
            w.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
            continue
        if tie and name == "lm_head.weight":
            continue
        t = tensor.float().numpy()
        gguf_name = _gguf_name(name)
        kind = gguf_name.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = c.num_attention_heads if kind == "attn_q" else c.num_key_value_heads
            t = _llama_cpp_permute(t, heads)
        layer = int(gguf_name.split(".")[1]) if gguf_name.startswith("blk.") else 0
        qtype = _types(layer).get(kind, T.F32) if quantized and t.ndim == 2 else T.F32
        if gguf_name == "token_embd.weight" and quantized:
            qtype = T.F16
        if gguf_name == "output.weight" and quantized:
            qtype = T.Q8_0
        if qtype.name in _K_QUANT_SCALES:
            w.add_tensor(gguf_name, _k_quant_blocks(*t.shape, qtype, rng), raw_dtype=qtype)
        elif qtype == T.F32:
            w.add_tensor(gguf_name, t)
        elif qtype == T.F16:
            w.add_tensor(gguf_name, t.astype(np.float16))
        else:
            w.add_tensor(gguf_name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _split_experts(state_dict):
    """(name, tensor) of the HF model's state dict with each layer's stacked experts under
    llama.cpp's names: gate_up split into ffn_gate_exps and ffn_up_exps, down as ffn_down_exps."""
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            layer = name.split(".")[2]
            gate, up = tensor.chunk(2, dim=1)
            yield f"blk.{layer}.ffn_gate_exps.weight", gate
            yield f"blk.{layer}.ffn_up_exps.weight", up
        elif name.endswith("mlp.experts.down_proj"):
            yield f"blk.{name.split('.')[2]}.ffn_down_exps.weight", tensor
        else:
            yield name, tensor


def write_tokenizer_gguf(path, tokenizer: str = "llama", arch: str = "llama"):
    """A GGUF file with a tiny model's metadata and a tokenizer but no tensors: enough to load the
    tokenizer from, in a fraction of the time a model takes to build. transformers picks its
    tokenizer class by the architecture (Qwen2Tokenizer for qwen2 and qwen3)."""
    import gguf
    import transformers
    config = transformers.LlamaConfig(**SHAPE, vocab_size=len(tokenizer_tokens(tokenizer)))
    w = gguf.GGUFWriter(str(path), arch)
    _add_metadata(w, arch, config, tokenizer)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_metadata(w, arch: str, c, tokenizer: str) -> None:
    import gguf
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_name(f"tiny-{arch}")
    if arch == "qwen3_moe":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if tokenizer == "llama":
        _add_spm_tokenizer(w)
        return
    tokens = tokenizer_tokens()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHAT_TEMPLATE)


def _add_spm_tokenizer(w) -> None:
    """The keys llama.cpp's converter writes for a SentencePiece model (TinyLlama's file has these)."""
    pieces, scores, types = zip(*spm_vocabulary())
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(pieces.index("<unk>"))
    w.add_bos_token_id(pieces.index("<s>"))
    w.add_eos_token_id(pieces.index("</s>"))
    w.add_pad_token_id(pieces.index("</s>"))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(SPM_CHAT_TEMPLATE)


# llama.cpp's tensor names (its gguf-py/gguf/tensor_mapping.py), written out here independently
# of the engine's own table so that a mistake there shows up against HF's reading of the file.
_GGUF_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
               "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp"}


def _gguf_name(hf_name: str) -> str:
    module, _, kind = hf_name.rpartition(".")
    if module in _GGUF_NAMES:
        return f"{_GGUF_NAMES[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<module path>
    return f"blk.{layer}.{_GGUF_NAMES[rest]}.{kind}"


def hf_gguf_greedy(path, prompts, max_new_tokens):
    """HF transformers' greedy completions from the same GGUF file (it dequantizes it itself)."""
    return hf_greedy(path.parent, prompts, max_new_tokens, gguf_file=path.name)
