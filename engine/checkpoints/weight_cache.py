"""A GGUF model's weights as the CPU engine holds them after int4 or int8 quantization
(engine/layers/quantized.py), kept in a safetensors file in nvchat's cache and read back
memory-mapped on later starts: SmolLM2's Q4_1 file took 3.7 s of a 7.5 s `nvchat -p` start to be
dequantized and quantized again (bench_startup, 2-core box, 0cdd633), and the float32 model it went
through made most of that start's 1,064 MB peak.

What an entry holds: every parameter the model keeps after quantization (norms, biases, a tied
embedding table, experts left in float) and every quantized weight's tensors, exactly as the
engine uses them. The file is mapped, not read: the process holds no second copy, and pages the
engine never reads (most of an embedding table's rows) are never loaded.

Its key is the GGUF file's path, size and modification time, the quantization, the model's dtype,
the cache's format, torch's version and the CPU's vector width (torch packs int4 weights for it),
and the source of the code that turns a file into these tensors (so a change there builds entries
again instead of running stale weights). A hash of the key names the file; the key itself is in
the file's metadata and must match. So is an XXH3 hash of each tensor, checked before anything is
used (a CRC-32 took 0.12 s of the 0.14 s that reading SmolLM2's 198 MB entry back takes on the 2-core
box; XXH3 0.035):
an entry that was cut short, damaged or written by something else is deleted and built again, never
used. Entries are written under a temporary name and renamed into place."""
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import xxhash
from safetensors import safe_open
from safetensors.torch import save_file

from engine.checkpoints import gguf, loader
from engine.options import default_cache_dir
from engine.layers import quantized, weights

# Raised when what an entry holds or how it is laid out changes.
CACHE_FORMAT = 2
KIND = "cpu-weights"
# Each method's weight class on this machine, for a weight of rows of in_features values.
_QUANTIZED_WEIGHTS = {"int4": lambda in_features: quantized.int4_class(), "int8": quantized.int8_class}
# The modules whose code decides the cached tensors' values besides those that define the model's
# classes and layers: the GGUF reader and its dequantization, the loaders, the quantization.
_PRODUCERS = (gguf, loader, weights, quantized, sys.modules[__name__])
# A temporary file older than this is a write that was killed, not one under way (writing
# SmolLM2's entry takes under a second).
_ABANDONED_S = 3600
_READ_CHUNK = 8 << 20


class CacheMismatch(Exception):
    """A verified entry that does not fit the model built (it held weights the model has no place
    for, or lacked some): the entry is deleted, and the model, part-filled, must be built again."""


def _sources_digest(model) -> str:
    """A hash of the source of _PRODUCERS and of every engine module that defines the model's
    class, its bases or its layers (their weight loaders and quantize methods)."""
    classes = {*type(model).__mro__, *(type(m) for m in model.modules())}
    names = {module.__name__ for module in _PRODUCERS}
    names.update(c.__module__ for c in classes if c.__module__.split(".")[0] == "engine")
    digest = hashlib.sha256()
    for name in sorted(names):
        digest.update(name.encode())
        digest.update(Path(sys.modules[name].__file__).read_bytes())
    return digest.hexdigest()


def _digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.contiguous().reshape(-1).view(torch.uint8).numpy())


class WeightCache:
    """The entry for one GGUF file, quantization and dtype (cache_dir: None for nvchat's cache)."""

    def __init__(self, model_path: Path, quantization: str, dtype: torch.dtype, cache_dir: Path | None = None):
        if quantization not in _QUANTIZED_WEIGHTS:
            raise ValueError(f"the weight cache holds int4 or int8 weights, not {quantization!r}")
        self.model_path = Path(model_path).resolve()
        self.quantization = quantization
        self.dtype = dtype
        self.directory = (cache_dir or default_cache_dir()) / KIND

    def key(self, model) -> dict:
        st = self.model_path.stat()
        return {"format": CACHE_FORMAT, "file": str(self.model_path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                "quantization": self.quantization, "dtype": str(self.dtype), "torch": torch.__version__,
                "cpu": torch.backends.cpu.get_cpu_capability(), "model": type(model).__name__,
                "int4": quantized.int4_class().__name__, "int8": quantized.int8_class(32).__name__,
                "code": _sources_digest(model)}

    def _prefix(self) -> str:
        # What entries for this file, quantization and dtype share, whatever else their key holds:
        # a new entry replaces the older ones.
        path_hash = hashlib.sha256(str(self.model_path).encode()).hexdigest()[:8]
        return f"{self.model_path.stem}-{self.quantization}-{str(self.dtype).removeprefix('torch.')}-{path_hash}-"

    def entry(self, key: dict) -> Path:
        key_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{self._prefix()}{key_hash}.safetensors"

    # --- reading ---------------------------------------------------------------------------------

    def restore(self, model) -> bool:
        """Puts the entry's weights into model (built, its weights not loaded) and quantizes it with
        them, as load_weights and model.quantize would. False, with model untouched, where there is
        no usable entry (one that fails its checks is deleted); CacheMismatch where the entry passed
        its checks but does not fit the model."""
        key = self.key(model)
        entry = self.entry(key)
        try:
            checksums, layout = _checked(entry, key)
        except FileNotFoundError:
            return False
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):  # cut short, damaged, foreign
            _discard(entry)
            return False
        try:
            with safe_open(entry, framework="pt", device="cpu") as f:  # mapped: tensors are views of the file
                tensors = {name: f.get_tensor(name) for name in checksums}
        except Exception:  # safetensors' own checks of the header and sizes
            _discard(entry)
            return False
        try:
            _place(model, self.quantization, tensors, layout)
        except (KeyError, ValueError) as e:
            _discard(entry)
            raise CacheMismatch(f"{entry.name}: {e}") from None
        gguf.forget_opened()  # as load_weights: the parsed metadata is not needed again
        return True

    # --- writing ---------------------------------------------------------------------------------

    def save(self, model) -> Path | None:
        """Writes the entry for model (loaded and quantized); the entry, or None where the cache
        can't be written (a read-only or full disk: the next start builds the weights again)."""
        key = self.key(model)
        entry = self.entry(key)
        tensors, layout = _contents(model)
        metadata = {"key": json.dumps(key, sort_keys=True), "layout": json.dumps(layout),
                    "xxh3_64": json.dumps({name: _digest(t) for name, t in tensors.items()})}
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=".weights-", suffix=".tmp")
            os.close(fd)
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, entry)
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return None
        self._remove_older(entry)
        return entry

    def _remove_older(self, entry: Path) -> None:
        """Deletes the entries this one replaces (the file changed, or nvchat or torch did) and
        temporary files that killed writes left."""
        try:
            for other in self.directory.glob(f"{self._prefix()}*.safetensors"):
                if other != entry:
                    other.unlink(missing_ok=True)
            now = time.time()
            for tmp in self.directory.glob(".weights-*.tmp"):
                if now - tmp.stat().st_mtime > _ABANDONED_S:
                    tmp.unlink(missing_ok=True)
        except OSError:
            pass


def _discard(entry: Path) -> None:
    try:
        entry.unlink(missing_ok=True)
    except OSError:  # a cache that can't be written to: nothing was cached there either
        pass


def _contents(model) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors to save, by name, and the layout that tells them apart: {"quantized": {module:
    [method, out, in]}, "parameters": [names]}. A quantized weight's tensors are named
    "<module>#<part>", which no parameter's name can be."""
    tensors, quantized_modules = {}, {}
    for name, module in model.named_modules():
        weight = getattr(module, "quantized", None)
        if weight is None:
            continue
        quantized_modules[name] = [weight.method, *weight.shape]
        for part, t in weight.tensors().items():
            tensors[f"{name}#{part}"] = t.contiguous()
    parameters = []
    for name, param in model.named_parameters():
        tensors[name] = param.data.contiguous()
        parameters.append(name)
    return tensors, {"quantized": quantized_modules, "parameters": parameters}


def _checked(entry: Path, key: dict) -> tuple[dict[str, int], dict]:
    """The entry's checksums and layout once its key matches and every tensor's bytes match its
    hash; ValueError (or another error restore catches, on a mangled header) where not. The bytes are read
    from the file rather than through a mapping, so the check leaves no pages in the process's
    memory: the engine maps the file afterwards and touches only what it reads. A safetensors file
    is an 8-byte little-endian header length, a JSON header, then the tensors' bytes."""
    with open(entry, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        header_length = int.from_bytes(f.read(8), "little")
        if not 0 < header_length <= size - 8:
            raise ValueError("header length out of the file")
        header = json.loads(f.read(header_length))
        metadata = header.pop("__metadata__")
        if json.loads(metadata["key"]) != key:
            raise ValueError("written for another file, setting or version")
        checksums, layout = json.loads(metadata["xxh3_64"]), json.loads(metadata["layout"])
        if set(checksums) != set(header):
            raise ValueError("tensors and checksums differ")
        data_start = 8 + header_length
        spans = sorted((info["data_offsets"], name) for name, info in header.items())
        end = spans[-1][0][1] if spans else 0
        if data_start + end != size:
            raise ValueError(f"{size} bytes where the header accounts for {data_start + end}")
        buffer = bytearray(_READ_CHUNK)
        view = memoryview(buffer)
        for (start, stop), name in spans:
            f.seek(data_start + start)
            digest, left = xxhash.xxh3_64(), stop - start
            while left:
                n = f.readinto(view[:min(left, _READ_CHUNK)])
                if not n:
                    raise ValueError("cut short")
                digest.update(view[:n])
                left -= n
            if digest.intdigest() != checksums[name]:
                raise ValueError(f"{name} does not match its checksum")
    return checksums, layout


def _place(model, method: str, tensors: dict[str, torch.Tensor], layout: dict) -> None:
    """Quantizes model with the cached weights and points its parameters at the cached tensors."""
    prebuilt = {}
    for name, (weight_method, out_features, in_features) in layout["quantized"].items():
        cls = _QUANTIZED_WEIGHTS[weight_method](in_features)
        parts = {part: tensors.pop(f"{name}#{part}") for part in cls.tensor_specs(out_features, in_features)}
        prebuilt[name] = cls.from_tensors(parts, (out_features, in_features))
    model.quantize(method, prebuilt)
    quantized_modules = {name for name, module in model.named_modules() if getattr(module, "quantized", None) is not None}
    if quantized_modules != set(prebuilt):
        raise ValueError(f"the model quantizes {len(quantized_modules)} modules, the entry holds {len(prebuilt)}")
    params = dict(model.named_parameters())
    if set(params) != set(tensors) or set(params) != set(layout["parameters"]):
        missing, extra = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
        raise ValueError(f"parameters differ: missing {missing[:4]}, extra {extra[:4]}")
    for name, param in params.items():
        cached = tensors[name]
        if cached.shape != param.shape or cached.dtype != param.dtype:
            raise ValueError(f"{name} is {list(cached.shape)} {cached.dtype}, the model's "
                             f"{list(param.shape)} {param.dtype}")
    for name, param in params.items():
        param.data = tensors[name]
