import json
from pathlib import Path

from engine.checkpoints.gguf import open_gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def load_tokenizer(path: Path):
    """The checkpoint's tokenizer, or None when it ships none (random-weight benchmark shapes)."""
    if path.is_file():
        return open_gguf(path).load_tokenizer()
    if not any((path / f).exists() for f in _TOKENIZER_FILES):
        return None
    from transformers import (
        AutoTokenizer,  # start-up: ~2 s, and a GGUF file does without it
    )
    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


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
