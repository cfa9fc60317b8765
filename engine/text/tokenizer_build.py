"""A GGUF file's tokenizer built in a child process, `python -m engine.text.tokenizer FILE`, while
the engine loads the model: transformers builds it from the file's metadata in seconds of Python
(14-20 s for SmolLM2's on the H200 machine, transformers 5.17), the engine's start on a GPU leaves
cores idle beside it, and later starts read the result from nvchat's cache. Torch-free, so that the
CLI can start the child before it imports the engine (nvchat/backend.py); LLM takes over the child
that is running for its file, or starts one."""
import os
import subprocess
import sys
import threading
from pathlib import Path

from engine.checkpoints.gguf_paths import cache_entry, is_gguf

# Part of the cache entry's name: raised when what is saved changes, so older entries are built again
# (2: clean-up switched off, see engine/text/tokenizer.py).
_GGUF_TOKENIZER_VERSION = 2

_builds: dict[Path, subprocess.Popen] = {}  # file -> its child, once started
_builds_lock = threading.Lock()  # LLM may be made on a thread of the app's while the CLI started one


def gguf_tokenizer_entry(path: Path, cache_dir: Path | None) -> Path:
    """Where the tokenizer built from a GGUF file is kept (cache_dir: None for nvchat's cache)."""
    return cache_entry(path, cache_dir, "gguf-tokenizers", f"-v{_GGUF_TOKENIZER_VERSION}")


def _gguf_file(model) -> Path | None:
    path = Path(model).expanduser()
    return path.resolve() if path.is_file() and is_gguf(path) else None


def start_gguf_tokenizer_build(model) -> subprocess.Popen | None:
    """Where `model` is a GGUF file whose tokenizer is not in nvchat's cache yet, the child building
    it: the one this process started already, while it runs, else a new one. None for any other
    model. Once the child has ended, load_tokenizer finds the entry, or, where the build failed,
    builds it itself and raises the error."""
    path = _gguf_file(model)
    if path is None:
        return None
    with _builds_lock:
        if (gguf_tokenizer_entry(path, None) / "tokenizer_config.json").exists():
            _builds.pop(path, None)
            return None
        build = _builds.get(path)
        if build is None or build.poll() is not None:
            source_root = str(Path(__file__).resolve().parents[2])
            env = dict(os.environ, CUDA_VISIBLE_DEVICES="",
                       PYTHONPATH=os.pathsep.join(p for p in (source_root, os.environ.get("PYTHONPATH")) if p))
            build = _builds[path] = subprocess.Popen(
                [sys.executable, "-m", "engine.text.tokenizer", str(path)], env=env,
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return build


def stop_gguf_tokenizer_build(model) -> None:
    """Stops a child started for `model` that the engine will not wait for (it runs on the CPU,
    where the model's loading keeps the cores busy and the tokenizer is built in this process)."""
    path = _gguf_file(model)
    with _builds_lock:
        build = _builds.pop(path, None) if path is not None else None
    if build is not None and build.poll() is None:
        build.kill()
        build.wait()
