"""GGUF checkpoints (llama.cpp's one-file format): the model's config is built from the file's
metadata, its tensors are dequantized to float32 at load time and placed in the engine's own
layers (which cast them to the engine's dtype); its tokenizer and chat template come from the
metadata (engine/text/tokenizer.py builds it). The `gguf` package reads and dequantizes; nothing here parses the
format itself. Its reader turns every string of the vocabulary into numpy views (seconds for a
real one), so what the engine needs of the metadata (the scalar fields, the arrays' lengths, the
tensor table) is kept in nvchat's cache, keyed by the file's path, size and time, for later starts."""
import collections
import contextlib
import functools
import json
import os
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from engine.checkpoints.errors import ModelError
from engine.checkpoints.gguf_paths import cache_entry
from engine.checkpoints.model_config import GGUF_MODEL_TYPES, ModelConfig
from engine.models.registry import ARCHITECTURES as MODELS

ARCHITECTURES = {"llama": MODELS["LlamaForCausalLM"], "qwen2": MODELS["Qwen2ForCausalLM"],
                 "qwen3": MODELS["Qwen3ForCausalLM"], "qwen3moe": MODELS["Qwen3MoeForCausalLM"]}

# Tensor types dequantized at load time. gguf can read more (the i-quants, ternary types), but
# these are the ones checked here; anything else is refused by name rather than trusted blindly.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Types holding at most 4 bits a weight, in blocks of 32 (or 256) along a row.
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K")

_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_BLOCK_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate"}
# A mixture-of-experts layer's experts, stacked in one tensor [experts, rows, columns] each.
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor, or None for one the engine has no place for. A
    stacked experts tensor's name has "{expert}" where each expert's number goes."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK_TENSOR.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _EXPERT_NAMES:
        return f"model.layers.{m.group(1)}.mlp.experts.{{expert}}.{_EXPERT_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders each llama q/k head's rows so that RoPE rotates adjacent
    pairs (GPT-J style); the engine rotates the two halves of a head (NeoX style), as HF's
    checkpoints are laid out. This puts each head's rows back: row 2i+j of the file is row
    j*half+i of the head."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_INDEX_VERSION = 1


@functools.cache
def _plain_array_reader():
    """gguf's reader, reading through a plain ndarray view of the file rather than np.memmap: the
    reader takes a view of the file for every value, and for a real vocabulary's metadata (SmolLM2:
    49,152 tokens, 48,900 merges) np.memmap's Python-level __getitem__ and __array_finalize__ were
    most of its 2.1 s (0.7 s through the plain view, 2-core box). The reader keeps the view
    in its `data` attribute, from which every value and tensor is sliced."""
    import gguf  # start-up: only when the index is not cached yet

    class PlainArrayReader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.ndarray) -> None:
            self._plain = mapped.view(np.ndarray)

    return PlainArrayReader


def _read_index(path: Path) -> tuple[dict, object]:
    """The file's metadata as the engine uses it, and the gguf package's reader it was read with."""
    import gguf  # start-up: only when the index is not cached yet
    try:
        reader = _plain_array_reader()(path)
        fields, lengths = {}, {}
        for name, field in reader.fields.items():
            if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
                lengths[name] = len(field.data)
            else:
                fields[name] = field.contents()
        tensors = [(t.name, t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset))
                   for t in reader.tensors]
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors... on bad bytes
        raise ModelError(f"{path} is not a readable GGUF file (corrupt or truncated?): {e}") from None
    return {"version": _INDEX_VERSION, "fields": fields, "array_lengths": lengths, "tensors": tensors}, reader


def _cached_index(path: Path, cache_dir: Path | None) -> tuple[dict, object | None]:
    """The file's index, from the cache or read now; and the reader, where it was read now."""
    # The key stays in the name: a stem with dots in it ("SmolLM2-135M-Instruct.Q4_1") is cut at
    # its last dot by with_suffix, which left every such file of one name sharing one entry.
    entry = cache_entry(path, cache_dir, "gguf-index", ".json")
    try:
        index = json.loads(entry.read_text())
        if index.get("version") == _INDEX_VERSION:
            return index, None
    except (OSError, ValueError):  # none yet, or damaged: read the file again
        pass
    index, reader = _read_index(path)
    try:
        text = json.dumps(index)
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".index-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, entry)
    except (OSError, TypeError, ValueError):  # a read-only cache, or a field JSON can't hold: no harm
        pass
    return index, reader


class GGUFCheckpoint:
    def __init__(self, path: Path, cache_dir: Path | None = None):
        self.path = path
        self.cache_dir = cache_dir
        index, self._reader = _cached_index(path, cache_dir)
        self.fields, self.array_lengths = index["fields"], index["array_lengths"]
        self.tensor_table = [(name, qtype, tuple(dims), offset) for name, qtype, dims, offset in index["tensors"]]
        self.architecture_name = self._field("general.architecture")
        if self.architecture_name not in ARCHITECTURES:
            raise ModelError(f"{path.name}: unsupported GGUF architecture {self.architecture_name!r}; "
                             f"nvchat runs {', '.join(ARCHITECTURES)}")
        self.architecture = ARCHITECTURES[self.architecture_name]
        bad = sorted({qtype for _, qtype, _, _ in self.tensor_table} - set(SUPPORTED_TYPES))
        if bad:
            raise ModelError(f"{path.name}: unsupported GGUF tensor type {', '.join(bad)}; "
                             f"nvchat dequantizes {', '.join(SUPPORTED_TYPES)}")
        self.hf_config = self._hf_config()

    @property
    def projections_at_four_bits(self) -> bool:
        """Whether every weight matrix of the layers is stored in 4 bits or fewer: then int4
        weights (engine/layers/quantized.py) lose little the file had not lost already."""
        matrices = [qtype for name, qtype, dims, _ in self.tensor_table if name.startswith("blk.") and len(dims) == 2]
        return bool(matrices) and all(qtype in FOUR_BIT_TYPES for qtype in matrices)

    def _field(self, key: str, default=...):
        """A scalar or string field of the metadata."""
        if key not in self.fields:
            if default is ...:
                raise ModelError(f"{self.path.name}: GGUF metadata lacks {key!r}")
            return default
        return self.fields[key]

    def _hf_config(self) -> ModelConfig:
        arch = self.architecture_name
        key = lambda name, default=...: self._field(f"{arch}.{name}", default)  # noqa: E731
        heads = key("attention.head_count")
        hidden = key("embedding_length")
        kv_heads = key("attention.head_count_kv", heads)
        names = {name for name, _, _, _ in self.tensor_table}
        has_output = "output.weight" in names
        vocab = key("vocab_size", None) or self.array_lengths.get("tokenizer.ggml.tokens")
        if not vocab:
            raise ModelError(f"{self.path.name}: GGUF metadata lacks 'tokenizer.ggml.tokens'")
        if arch == "qwen3moe":
            expert_ffn = key("expert_feed_forward_length")
            # llama.cpp's qwen3moe graph always renormalizes the chosen experts' weights.
            moe = dict(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                       moe_intermediate_size=expert_ffn, norm_topk_prob=True)
            ffn = key("feed_forward_length", expert_ffn)
        else:
            moe, ffn = {}, key("feed_forward_length")
        values = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                      num_hidden_layers=key("block_count"), num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=key("attention.key_length", hidden // heads),
                      max_position_embeddings=key("context_length"),
                      rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
                      rope_theta=key("rope.freq_base", 10000.0), tie_word_embeddings=not has_output,
                      bos_token_id=self._field("tokenizer.ggml.bos_token_id", None),
                      eos_token_id=self._field("tokenizer.ggml.eos_token_id", None), **moe)
        rotary = key("rope.dimension_count", values["head_dim"])
        if rotary != values["head_dim"]:
            raise ModelError(f"{self.path.name}: RoPE over {rotary} of each head's {values['head_dim']} dimensions "
                             "(partial rotary) is not supported")
        if self._field(f"{arch}.rope.scaling.type", "none") not in ("none", None) or any(
                name == "rope_freqs.weight" for name in names):
            raise ModelError(f"{self.path.name}: RoPE scaling in a GGUF file is not supported yet")
        if arch == "llama":
            values["attention_bias"] = any(name.endswith("attn_q.bias") for name in names)
        return ModelConfig(GGUF_MODEL_TYPES[arch], architectures=[self.architecture.__name__], **values)

    @contextlib.contextmanager
    def metadata_read_once(self):
        """Within the block, gguf's reader of this file (transformers builds a GGUF tokenizer through
        it) is the one the index was just read with, where this process read it: parsing a real
        vocabulary's metadata is most of the reading, 5 s of the 2-core box's first start with
        SmolLM2, and transformers would parse the file again. The reader is let go after the block;
        with the index from the cache there is none, and transformers reads the file itself."""
        reader, self._reader = self._reader, None
        if reader is None:
            yield
            return
        import gguf  # start-up: only where _read_index imported it already
        made_by_gguf = gguf.GGUFReader
        path = self.path.resolve()

        def reader_of(file, *args, **kwargs):
            if not args and not kwargs and Path(file).resolve() == path:
                return reader
            return made_by_gguf(file, *args, **kwargs)
        gguf.GGUFReader = reader_of
        try:
            yield
        finally:
            gguf.GGUFReader = made_by_gguf

    def tensors(self, waiting_bytes_bound: int = 1 << 30):
        """(Hugging Face name, float32 tensor) for each tensor of the file, in the file's order; a
        stacked experts tensor as one tensor per expert. The tensors are dequantized on a few threads
        (numpy releases the GIL in gguf's array arithmetic) while the caller places the ones before:
        SmolLM2's Q4_1 file took 1.0-1.2 s of a GPU start one tensor at a time. Two tensors are in
        hand at any time, and more while the float32 results not yet taken stay within
        waiting_bytes_bound."""
        import gguf  # start-up: as in _read_index, only once the weights are read
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        table = list(self.tensor_table)
        with ThreadPoolExecutor(max_workers=_dequantize_threads(), thread_name_prefix="gguf-dequantize") as pool:
            pending: collections.deque = collections.deque()
            waiting_bytes = 0
            try:
                for entry in table:
                    size = 4 * int(np.prod(entry[2]))
                    while len(pending) >= 2 and waiting_bytes + size > waiting_bytes_bound:
                        future, done_size = pending.popleft()
                        waiting_bytes -= done_size
                        yield from future.result()
                    pending.append((pool.submit(self._dequantized, gguf, data, entry), size))
                    waiting_bytes += size
                while pending:
                    future, done_size = pending.popleft()
                    yield from future.result()
            finally:  # an error, or a caller that stopped early: nothing more starts
                for future, _ in pending:
                    future.cancel()

    def _dequantized(self, gguf, data: np.ndarray, entry) -> list[tuple[str, torch.Tensor]]:
        """One entry of the tensor table as (Hugging Face name, float32 tensor) pairs: one, or one
        per expert of a stacked experts tensor."""
        file_name, type_name, dims, offset = entry
        name = hf_tensor_name(file_name)
        if name is None:
            raise ModelError(f"{self.path.name} has tensor {file_name!r}, which this model has no place for")
        qtype = gguf.GGMLQuantizationType[type_name]
        shape = tuple(reversed(dims))  # GGUF lists dimensions innermost first
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        raw = data[offset:offset + int(np.prod(shape)) * block_bytes // block]
        try:
            # As the gguf reader views a tensor's bytes: plain floats as themselves, the rest as
            # rows of bytes, which its dequantize expects.
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                raw = raw.view(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16).reshape(shape)
            else:
                raw = raw.reshape(gguf.quant_shape_to_byte_shape(shape, qtype))
            w = _dequantize(raw, qtype) if qtype.name in _BLOCK_TYPES else gguf.quants.dequantize(raw, qtype)
        except Exception as e:
            raise ModelError(f"{self.path.name}: can't dequantize {file_name} ({type_name}): {e}") from None
        w = w.reshape(shape)
        c = self.hf_config
        if self.architecture_name == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rope_rows(w, c.num_attention_heads)
        elif self.architecture_name == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rope_rows(w, c.num_key_value_heads)
        w = np.ascontiguousarray(w, dtype=np.float32)
        w = torch.from_numpy(w if w.flags.writeable else w.copy())  # F32 reads map the file
        if "{expert}" in name:
            return [(name.format(expert=expert), part) for expert, part in enumerate(w)]
        return [(name, w)]


def _dequantize_threads() -> int:
    """Threads for dequantizing: the cores this process may use, at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


# Quantized types, dequantized by _dequantize (the F32 and F16 views need no work).
_BLOCK_TYPES = frozenset(SUPPORTED_TYPES) - {"F32", "F16"}
_DEQUANTIZE_ROWS = 2048


def _dequantize(raw: np.ndarray, qtype) -> np.ndarray:
    """gguf's dequantization of a quantized tensor's rows of bytes, 2,048 rows a call: its own
    dequantize splits the tensor into groups of 16 rows, and that Python loop took 1.6-1.9 s of the
    2-core box's CPU for SmolLM2's Q4_1 file against 0.6-0.7 s this way, bit for bit the same
    floats (tests/test_gguf.py)."""
    import gguf  # start-up: as in _read_index
    kind = getattr(gguf.quants, qtype.name)
    kind.init_grid()
    rows = raw.reshape(-1, raw.shape[-1])
    out = np.empty((rows.shape[0], rows.shape[1] // kind.type_size * kind.block_size), np.float32)
    for start in range(0, rows.shape[0], _DEQUANTIZE_ROWS):
        out[start:start + _DEQUANTIZE_ROWS] = kind.dequantize_rows(rows[start:start + _DEQUANTIZE_ROWS])
    return out


@functools.lru_cache(maxsize=1)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFCheckpoint:
    return GGUFCheckpoint(Path(path))


def open_gguf(path: Path) -> GGUFCheckpoint:
    """The file opened once per process for its config, tensors and tokenizer (reading the
    metadata of a real vocabulary takes seconds)."""
    st = os.stat(path)
    return _open_cached(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


def forget_opened() -> None:
    _open_cached.cache_clear()
