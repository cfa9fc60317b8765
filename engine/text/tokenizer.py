import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from engine.checkpoints.errors import ModelError
from engine.checkpoints.gguf import open_gguf
from engine.text.chat_tokenizer import ChatTokenizer, usable
from engine.text.tokenizer_build import gguf_tokenizer_entry

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(path: Path, cache_dir: Path | None = None):
    """The checkpoint's tokenizer, or None when it ships none (random-weight benchmark shapes).
    cache_dir: where a GGUF file's tokenizer is kept (default nvchat's cache)."""
    if path.is_file():
        return _gguf_tokenizer(path, cache_dir)
    if not any((path / f).exists() for f in _TOKENIZER_FILES):
        return None
    if usable(path):
        return ChatTokenizer(path)
    from transformers import (
        AutoTokenizer,  # start-up: ~1 s of CPU; only for a tokenizer ChatTokenizer does not run
    )
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def _gguf_tokenizer(path: Path, cache_dir: Path | None):
    """transformers builds the tokenizer from a GGUF file's metadata (seconds for a real vocabulary);
    the result is kept in nvchat's cache, keyed by the file's path, size and time, and later starts
    read it back through ChatTokenizer: its tokenizer.json is the pipeline transformers built. The
    first start builds it from the metadata the engine has just parsed (metadata_read_once)."""
    checkpoint = open_gguf(path)
    with checkpoint.metadata_read_once():
        return _built_gguf_tokenizer(path, gguf_tokenizer_entry(checkpoint.path, cache_dir or checkpoint.cache_dir))


def _built_gguf_tokenizer(path: Path, cached: Path):
    """The tokenizer from its cache entry `cached`, or built by transformers and saved there."""
    if (cached / "tokenizer_config.json").exists():
        try:
            if usable(cached, any_class=True):
                return ChatTokenizer(cached)
            from transformers import AutoTokenizer  # start-up: as in load_tokenizer
            return AutoTokenizer.from_pretrained(cached)
        except Exception:  # a damaged cache entry: build it again
            shutil.rmtree(cached, ignore_errors=True)
    from transformers import (
        AutoTokenizer,  # start-up: only the first start on a file builds its tokenizer
    )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:
        raise ModelError(f"{path.name}: can't build a tokenizer from its GGUF metadata: {e}") from None
    # transformers 5.17 turns clean-up on for a byte-level GGUF vocabulary (5.24 leaves it off), so
    # usable() refused the saved copy and every start loaded it through transformers (7.6 s of
    # `nvchat -p`'s start with SmolLM2 on the GPU machine, bench_startup). transformers skips the
    # clean-up pass for a BPE model whatever the setting, and every tokenizer it builds from a GGUF
    # file nvchat runs is one: switched off, no decoded text changes.
    if type(tokenizer.backend_tokenizer.model).__name__ == "BPE":
        tokenizer.clean_up_tokenization_spaces = False
    tmp = None
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=cached.parent))
        tokenizer.save_pretrained(tmp)
        os.rename(tmp, cached)
    except OSError:  # a read-only cache, or another process got there first: no harm
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return tokenizer


def eos_token_ids(path: Path, tokenizer, hf_config) -> set[int]:
    """Every id that ends a reply: the tokenizer's EOS plus generation_config's (Qwen chat models
    end turns with <|im_end|> but name <|endoftext|> as EOS)."""
    ids: set[int] = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    gen_config = path / "generation_config.json"
    if gen_config.exists():
        add(json.loads(gen_config.read_text()).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


if __name__ == "__main__":  # engine/text/tokenizer_build.py's child process: python -m engine.text.tokenizer FILE.gguf
    _gguf_tokenizer(Path(sys.argv[1]), None)
