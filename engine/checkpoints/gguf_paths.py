"""What a GGUF file is, and where things built from one are cached: torch-free, so that the CLI can
start the file's tokenizer build before it imports the engine (engine/text/tokenizer_build.py)."""
import hashlib
from pathlib import Path

from engine.options import default_cache_dir


def is_gguf(path: Path) -> bool:
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def cache_entry(path: Path, cache_dir: Path | None, kind: str, suffix: str = "") -> Path:
    """Where something built from the file is kept: changes with the file's path, size and time."""
    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()) / kind / f"{path.stem}-{key}{suffix}"
