import json
import os
import shutil
import tempfile
from pathlib import Path

from engine.checkpoints.errors import ModelError
from engine.checkpoints.gguf import cache_entry, open_gguf
from engine.text.chat_tokenizer import ChatTokenizer, usable

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
    read it back through ChatTokenizer: its tokenizer.json is the pipeline transformers built."""
    checkpoint = open_gguf(path)
    cached = cache_entry(checkpoint.path, cache_dir or checkpoint.cache_dir, "gguf-tokenizers")
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
