"""Hugging Face Hub repo ids as models: the local HF cache first, else a download through
huggingface_hub of the files the engine reads (safetensors weights, JSON configs, tokenizer
files), never pickled weights or code."""
from pathlib import Path

from engine.checkpoints.errors import ModelError

# safetensors weights and their index, config.json, generation_config.json and tokenizer_config.json;
# tokenizer.json, or the files a slow tokenizer is rebuilt from.
DOWNLOAD_PATTERNS = ["*.safetensors", "*.json", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.txt"]


def looks_like_repo_id(model: str) -> bool:
    return model.count("/") == 1 and not model.startswith((".", "/", "~")) and all(model.split("/"))


def _complete(snapshot: Path) -> bool:
    """A cached snapshot can hold only some files (a config fetched on its own, an interrupted
    download); the engine needs the config and the weights."""
    return (snapshot / "config.json").exists() and any(snapshot.glob("*.safetensors"))


def fetch_repo(repo_id: str, progress=None) -> Path:
    """The repo's snapshot directory in the HF cache, downloading the missing files. huggingface_hub
    draws its progress bars on stderr; progress (a callable taking one string) is told the stage."""
    # start-up: huggingface_hub loads only for a repo id, not for a local model
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    fetch_hint = f"fetch it with `hf download {repo_id}` on a machine that is online"
    try:
        cached = Path(snapshot_download(repo_id, local_files_only=True))
        if _complete(cached):
            return cached
    except HFValidationError as e:
        raise ModelError(f"model {repo_id!r} is neither a local path nor a valid Hugging Face repo id: {e}") from None
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise ModelError(f"model {repo_id!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
                         f"{fetch_hint}")
    if progress is not None:
        progress(f"downloading {repo_id} from the Hugging Face Hub")
    try:
        path = Path(snapshot_download(repo_id, allow_patterns=DOWNLOAD_PATTERNS))
    except GatedRepoError:
        raise ModelError(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on the Hub and "
                         "log in with `hf auth login`") from None
    except RepositoryNotFoundError:
        raise ModelError(f"no model {repo_id!r} on the Hugging Face Hub (or it is private: log in with "
                         "`hf auth login`)") from None
    except (LocalEntryNotFoundError, OSError):  # no connection, DNS, timeouts
        raise ModelError(f"model {repo_id!r} is not in the local Hugging Face cache and {constants.ENDPOINT} "
                         f"can't be reached: {fetch_hint}") from None
    if not _complete(path):
        # huggingface_hub falls back to what is cached when the Hub can't be reached, so this is
        # either a repo without safetensors weights or a partial cache and no network.
        raise ModelError(f"model {repo_id!r}: no config.json and safetensors weights in the Hugging Face cache "
                         "after a download; the repo may hold only pickled weights (never loaded), or "
                         f"{constants.ENDPOINT} can't be reached: {fetch_hint}")
    return path
