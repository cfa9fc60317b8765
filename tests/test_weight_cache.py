"""A GGUF model's int4 / int8 weights are cached after the first start (engine/checkpoints/
weight_cache.py): the next engine on the same file maps them from the cache and answers token for
token as the first did; an entry that was cut short, damaged or written for something else is
deleted and built again, never used; a changed file builds a new entry."""
import os
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.checkpoints.weight_cache import KIND, WeightCache
from engine.layers.quantized import Int4Weight, Int8Weight, quantize
from tests.conftest import random_prompts
from tests.gguf_files import tokenizer_tokens, write_tiny_gguf

FROM_CACHE, FROM_FILE, SAVING = "loading the cached weights", "loading weights", "caching the weights"
PROMPTS = random_prompts([5, 23, 11], vocab=len(tokenizer_tokens()), seed=3)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """nvchat's cache for one test, not the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "nvchat" / KIND


@pytest.fixture(scope="module")
def tied_gguf(tmp_path_factory):
    """Tied embeddings: the head in int4 beside the float table, with int4."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-tied.gguf", arch="qwen3", tie=True)


@pytest.fixture(scope="module")
def untied_gguf(tmp_path_factory):
    """An untied head, which is int8 whatever the layers' quantization."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-untied.gguf", arch="llama", seed=1)


def start(path: Path, quantization: str = "int4") -> tuple[list[str], list[list[int]]]:
    """One engine's start-up stages and its greedy completions of PROMPTS."""
    stages = []
    with LLM(str(path), device="cpu", quantization=quantization, kvcache_block_size=8, num_kvcache_blocks=32,
             progress=stages.append) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        if FROM_CACHE in stages and FROM_FILE not in stages:
            # The weights are the file's pages, not a copy: the entry is mapped into the process.
            [entry] = Path(os.environ["XDG_CACHE_HOME"], "nvchat", KIND).glob(f"*-{quantization}-*")
            assert str(entry) in Path("/proc/self/maps").read_text()
    return stages, [o["token_ids"] for o in outs]


def loaded_from_cache(stages: list[str]) -> bool:
    assert FROM_CACHE in stages
    return FROM_FILE not in stages


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """Stacked experts, which stay in float (one parameter each), beside int4 attention."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-moe.gguf", arch="qwen3_moe", seed=2)


@pytest.mark.parametrize("quantization, fixture", [("int4", "tied_gguf"), ("int8", "untied_gguf"),
                                                   ("int4", "untied_gguf"), ("int4", "moe_gguf")])
def test_a_second_engine_on_the_same_file_maps_the_cached_weights_and_answers_the_same(
        request, cache_dir, quantization, fixture):
    path = request.getfixturevalue(fixture)
    first_stages, first = start(path, quantization)
    assert not loaded_from_cache(first_stages) and SAVING in first_stages
    [entry] = cache_dir.iterdir()
    second_stages, second = start(path, quantization)
    assert loaded_from_cache(second_stages) and SAVING not in second_stages
    assert second == first
    assert list(cache_dir.iterdir()) == [entry]


def test_each_quantization_has_its_own_entry(tied_gguf, cache_dir):
    start(tied_gguf, "int4")
    stages, _ = start(tied_gguf, "int8")
    assert not loaded_from_cache(stages)
    assert len(list(cache_dir.glob("*.safetensors"))) == 2
    assert loaded_from_cache(start(tied_gguf, "int4")[0]) and loaded_from_cache(start(tied_gguf, "int8")[0])


def _flip(data: bytearray, at: int) -> bytearray:
    data[at] ^= 0x10
    return data


# Where a damaged entry goes wrong: its length, a tensor's bytes, its JSON header.
DAMAGE = {
    "truncated": lambda data: data[:len(data) - 100],
    "one byte short": lambda data: data[:-1],
    "byte flipped in a tensor": lambda data: _flip(data, len(data) // 2),
    "byte flipped in the last tensor": lambda data: _flip(data, len(data) - 3),
    "byte flipped in the header": lambda data: _flip(data, 40),
    "empty": lambda data: b"",
    "longer": lambda data: data + b"\0" * 8,
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_deleted_and_built_again(tied_gguf, cache_dir, damage):
    _, expected = start(tied_gguf)
    [entry] = cache_dir.iterdir()
    entry.write_bytes(DAMAGE[damage](bytearray(entry.read_bytes())))
    stages, again = start(tied_gguf)
    assert not loaded_from_cache(stages) and SAVING in stages
    assert again == expected
    stages, third = start(tied_gguf)  # the entry built again is whole
    assert loaded_from_cache(stages) and third == expected


def test_an_entry_written_for_another_file_is_not_used(tied_gguf, tmp_path, cache_dir):
    """An entry is only ever read under its own key's name, but one put there by hand (or by a
    hash collision) says in its metadata what it was written for."""
    other = write_tiny_gguf(tmp_path / "other.gguf", arch="qwen3", tie=True, seed=7)
    _, other_tokens = start(other)
    [other_entry] = cache_dir.iterdir()
    _, expected = start(tied_gguf)
    [entry] = set(cache_dir.iterdir()) - {other_entry}
    shutil.copyfile(other_entry, entry)
    stages, again = start(tied_gguf)
    assert not loaded_from_cache(stages) and again == expected != other_tokens


def test_a_changed_file_builds_a_new_entry_in_place_of_the_old(tied_gguf, tmp_path, cache_dir):
    path = tmp_path / "model.gguf"
    shutil.copyfile(tied_gguf, path)
    _, before = start(path)
    [old_entry] = cache_dir.iterdir()
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # same bytes, newer time
    stages, _ = start(path)
    assert not loaded_from_cache(stages)
    [new_entry] = cache_dir.iterdir()
    assert new_entry != old_entry
    # New weights of another size: the entry follows the file, whatever its time says.
    write_tiny_gguf(path, arch="qwen3", tie=True, seed=9)
    path.write_bytes(path.read_bytes() + b"\0" * 64)  # GGUF readers ignore what follows the tensors
    os.utime(path, ns=(st.st_atime_ns, new_entry.stat().st_mtime_ns))
    stages, after = start(path)
    assert not loaded_from_cache(stages) and after != before
    assert loaded_from_cache(start(path)[0])


def test_an_entry_that_passes_its_checks_but_does_not_fit_the_model_is_replaced(
        tied_gguf, untied_gguf, tmp_path, cache_dir, monkeypatch):
    """Only a key that misses something the weights depend on could let this happen: the model the
    entry part-filled is built again and loaded from the file."""
    monkeypatch.setattr(WeightCache, "key", lambda self, model: {"the same for": "every file"})
    path = tmp_path / "model.gguf"
    shutil.copyfile(tied_gguf, path)
    start(path)
    shutil.copyfile(untied_gguf, path)  # another architecture, shapes and head under the same key
    stages, tokens = start(path)
    assert stages.index(FROM_CACHE) < stages.index(FROM_FILE) < stages.index(SAVING)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))
    assert tokens == start(path)[1]


def test_a_cache_that_cannot_be_written_only_costs_the_next_start(tied_gguf, cache_dir):
    cache_dir.parent.mkdir(parents=True)
    cache_dir.write_text("a file where the directory would go")
    _, expected = start(tied_gguf)
    stages, again = start(tied_gguf)
    assert not loaded_from_cache(stages) and again == expected


def test_a_quantized_weight_rebuilt_from_its_tensors_multiplies_the_same():
    w = torch.randn(40, 64)
    x = torch.randn(3, 64)
    for cls in (Int4Weight, Int8Weight):
        weight = cls(w)
        again = cls.from_tensors({name: t.clone() for name, t in weight.tensors().items()}, weight.shape)
        assert torch.equal(again(x), weight(x))
        with pytest.raises(ValueError, match="must be"):
            cls.from_tensors(weight.tensors(), (40, 96))
        with pytest.raises(ValueError, match="can't stand for"):
            quantize(w[:, :32], cls.method, prebuilt=weight)


def test_the_cache_holds_only_quantized_weights():
    with pytest.raises(ValueError, match="int4 or int8"):
        WeightCache(Path("model.gguf"), "fp8", torch.float32)
