"""Hugging Face repo ids as --model, offline: a repo laid out in a local HF cache (the layout
huggingface_hub documents: refs/main names the snapshot) is used without the network, and a repo
that isn't there is one clear line, whether HF_HUB_OFFLINE is set or the Hub can't be reached."""
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMMIT = "0123456789abcdef0123456789abcdef01234567"
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: connections are refused at once


def _cache_repo(cache: Path, repo_id: str, source: Path, files=None) -> None:
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for f in source.iterdir():
        if files is None or f.name in files:
            shutil.copy(f, snapshot / f.name)


@pytest.fixture(scope="module")
def runs(demo_model_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    cache = root / "hf-cache"
    _cache_repo(cache, "tiny-org/chat-model", demo_model_path)
    _cache_repo(cache, "tiny-org/config-only", demo_model_path, files={"config.json"})
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "XDG_DATA_HOME": str(root / "data"),
           "XDG_CONFIG_HOME": str(root / "config"), "XDG_CACHE_HOME": str(root / "cache"), "OMP_NUM_THREADS": "1"}
    env.pop("HF_HUB_OFFLINE", None)
    jobs = {
        "cached": ("tiny-org/chat-model", {"HF_ENDPOINT": UNREACHABLE}),
        "config_only": ("tiny-org/config-only", {"HF_ENDPOINT": UNREACHABLE}),
        "unreachable": ("nobody/nothing", {"HF_ENDPOINT": UNREACHABLE}),
        "offline": ("nobody/nothing", {"HF_HUB_OFFLINE": "1"}),
    }

    def run(model, extra_env):
        return subprocess.run([sys.executable, "-m", "nvchat.cli", "-p", "hi", "--model", model, "--device", "cpu",
                               "--max-model-len", "256", "--max-tokens", "8"],
                              cwd=REPO, env={**env, **extra_env}, capture_output=True, text=True, timeout=180)

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run, *job) for name, job in jobs.items()}
        return {name: f.result() for name, f in futures.items()}


def _error_line(result) -> str:
    assert result.returncode == 1 and result.stdout == "", result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_cached_repo_is_used_without_the_network(runs):
    result = runs["cached"]
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_an_incomplete_cached_repo_is_fetched_and_a_dead_network_named(runs):
    assert _error_line(runs["config_only"]) == (
        "nvchat: model 'tiny-org/config-only': no config.json and safetensors weights in the Hugging Face cache "
        f"after a download; the repo may hold only pickled weights (never loaded), or {UNREACHABLE} can't be "
        "reached: fetch it with `hf download tiny-org/config-only` on a machine that is online")


def test_an_unreachable_hub_is_one_line_naming_the_repo(runs):
    assert _error_line(runs["unreachable"]) == (
        f"nvchat: model 'nobody/nothing' is not in the local Hugging Face cache and {UNREACHABLE} can't be "
        "reached: fetch it with `hf download nobody/nothing` on a machine that is online")


def test_offline_with_nothing_cached_is_one_line_naming_the_repo(runs):
    assert _error_line(runs["offline"]) == (
        "nvchat: model 'nobody/nothing' is not in the local Hugging Face cache and HF_HUB_OFFLINE is set: "
        "fetch it with `hf download nobody/nothing` on a machine that is online")
