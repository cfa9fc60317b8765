"""What the GPU warm-up measures, kept for the next start of the same engine on the same GPU.

The KV cache gets what is left of gpu_memory_utilization once the weights, the costliest steps'
activations and the CUDA graphs' pool are counted (ModelRunner._blocks_that_fit_on_gpu). Finding the
last two takes the warm-up: the biggest steps run eagerly and every graph is captured once over a
scratch cache, then dropped. That was 1.3-1.8 s of a 6-7 s `nvchat -p` start with SmolLM2 on an H200
(bench_startup, 2026-11-27), and the result depends only on what the key below holds: the GPU, the
model's shape, the options that size the steps, the library versions and the engine's own code. So a
start whose key matches an entry takes the entry's figures instead.

The entry also keeps what the warm-up left loaded outside torch's allocator (CUDA loads kernels'
code lazily, and cuBLAS its workspaces): a start that skips the warm-up loads it later, after the
KV cache is sized, so it is set aside with the rest.

Entries are JSON files named by a hash of their key, which they hold and which must match; one that
can't be read is measured again and rewritten. Nothing here is needed: an unwritable cache only
means every start measures.
"""
import dataclasses
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path

import torch
import xxhash

from engine.options import default_cache_dir

KIND = "memory-plans"
# Raised when what an entry holds changes.
FORMAT = 1
# Options that do not change what a step or a graph needs on the device.
_UNRELATED = frozenset({"model_path", "gpu_memory_utilization", "num_kvcache_blocks", "host_cache_gib",
                        "disk_cache_dir", "disk_cache_gib", "load_format", "async_scheduling", "device"})
# The packages whose code decides what the warm-up measures.
_CODE_PACKAGES = ("engine", "kernels")


def _code_digest() -> str:
    digest = xxhash.xxh3_128()
    root = Path(__file__).resolve().parents[2]
    for package in _CODE_PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def plan_key(config, rank: int, device: torch.device) -> dict:
    """Everything the warm-up's figures depend on."""
    # Triton's version from its metadata: its import is under way on another thread
    # (kernels/warm_start.py), which importing it here would wait for.
    props = torch.cuda.get_device_properties(device)
    options = {f.name: str(getattr(config, f.name)) for f in dataclasses.fields(config) if f.name not in _UNRELATED}
    return {"format": FORMAT, "gpu": props.name, "gpu_memory": props.total_memory,
            "capability": [props.major, props.minor], "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": importlib.metadata.version("triton"), "hf_config": config.hf_config.to_dict(), "options": options,
            "rank": rank, "code": _code_digest()}


class MemoryPlanCache:
    """The entry for one key (cache_dir: None for nvchat's cache)."""

    def __init__(self, key: dict, cache_dir: Path | None = None):
        self.key = key
        name = xxhash.xxh3_128_hexdigest(json.dumps(key, sort_keys=True, default=str).encode())
        self.path = (cache_dir or default_cache_dir()) / KIND / f"{name}.json"

    def read(self) -> dict[str, int] | None:
        """The figures an earlier start measured under this key, or None."""
        try:
            entry = json.loads(self.path.read_text())
            if entry["key"] != json.loads(json.dumps(self.key, default=str)):
                return None
            needs = entry["needs"]
            if all(isinstance(needs.get(name), int) and needs[name] >= 0
                   for name in ("activations", "graph_pool", "loaded")):
                return needs
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        return None

    def write(self, needs: dict[str, int]) -> None:
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".plan-", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"key": self.key, "needs": needs}, f, default=str)
            os.replace(tmp, self.path)
        except OSError:  # a read-only or full cache: the next start measures again
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
