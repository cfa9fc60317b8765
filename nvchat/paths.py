"""Where nvchat keeps things, following the XDG base-directory spec."""
import os
from pathlib import Path


def _xdg(variable: str, fallback: str) -> Path:
    base = os.environ.get(variable)
    return Path(base) if base else Path.home() / fallback


def config_dir() -> Path:
    return _xdg("XDG_CONFIG_HOME", ".config") / "nvchat"


def data_dir() -> Path:
    return _xdg("XDG_DATA_HOME", ".local/share") / "nvchat"


def cache_dir() -> Path:
    return _xdg("XDG_CACHE_HOME", ".cache") / "nvchat"


def kv_cache_dir() -> Path:
    """The disk tier of the engine's KV cache (engine/core/kv_tiers.py)."""
    return cache_dir() / "kv"


def config_file() -> Path:
    return config_dir() / "config.toml"


def database_file() -> Path:
    return data_dir() / "conversations.sqlite3"


def repl_history_file() -> Path:
    return data_dir() / "repl_history"


def exports_dir() -> Path:
    return data_dir() / "exports"
