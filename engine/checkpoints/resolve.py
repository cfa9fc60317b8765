"""Finding and checking a model directory before anything heavy is loaded, so each problem is
one clear error that names it."""
import json
import os
from pathlib import Path

from engine.checkpoints.errors import ModelError
from engine.checkpoints.gguf_paths import is_gguf
from engine.checkpoints.hub import fetch_repo, looks_like_repo_id
from engine.models.registry import ARCHITECTURES


def resolve_model_path(model: str | os.PathLike, progress=None) -> Path:
    """A local directory or GGUF file, or a Hugging Face repo id: from the local HF cache, else
    downloaded (engine/checkpoints/hub.py; progress is told when a download starts)."""
    if not str(model).strip():  # Path("") is the current directory, which is rarely what was meant
        raise ModelError("the model path is empty; give a checkpoint's directory, a .gguf file or a repo id")
    path = Path(model).expanduser()
    if path.exists():
        if not path.is_dir():
            if not is_gguf(path):
                raise ModelError(f"model path {path} is a file but not a GGUF file; give a checkpoint's "
                                 "directory or a .gguf file")
        return path
    if isinstance(model, str) and looks_like_repo_id(model):
        return fetch_repo(model, progress)
    raise ModelError(f"model path {path} does not exist")


def weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise ModelError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = f" ({', '.join(pickled)} found: pickled weights are never loaded; convert them to safetensors)" if pickled else ""
        raise ModelError(f"no *.safetensors weights in {path}{hint}")
    return files


def check_checkpoint(path: Path, need_weights: bool = True) -> dict:
    """Returns config.json's contents once the directory looks like a supported checkpoint."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelError(f"no config.json in {path}: not a Hugging Face checkpoint directory")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{config_file} is not valid JSON: {e}") from None
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        name = ", ".join(archs) or f"model_type={raw.get('model_type')!r}"
        raise ModelError(f"unsupported model architecture {name}; nvchat runs {', '.join(ARCHITECTURES)}")
    if need_weights:
        weight_files(path)
    return raw


def architecture_of(raw_config: dict):
    return next(ARCHITECTURES[a] for a in raw_config["architectures"] if a in ARCHITECTURES)
