"""The engine's options are declared once (engine/options.py): every one is a flag of every mode and
a config.toml key, lands in the engine as given, and an unknown or bad one is named."""
import gc
from dataclasses import fields

import pytest

from engine import LLM, EngineOptions, EngineThread, SamplingParams
from engine.options import OPTION_NAMES, value_type
from nvchat import cli, paths
from nvchat.backend import open_backend
from nvchat.flags import settings_from_args
from nvchat.server import serve
from nvchat.settings import Settings, SettingsError, _toml_value, load_settings

PARSERS = {"nvchat": cli.build_parser, "nvchat serve": serve.build_parser}


@pytest.fixture(autouse=True)
def config_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # not the user's config.toml
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nor the user's KV blocks on disk


def another_value(option, current):
    """A value of the option's type other than `current`, so that a test sees it arrive."""
    kind = value_type(option.type)
    if option.metadata["choices"]:
        return next(c for c in option.metadata["choices"] if c != current)
    if kind is bool:
        return not current
    if kind is int:
        return (current or 1) + 2
    if kind is float:
        return current / 2 if current else 0.5
    return f"{option.name}-example"


def flag_for(option, value) -> list[str]:
    name = f"--{option.name.replace('_', '-')}"
    if isinstance(value, bool):
        return [name if value else f"--no-{name[2:]}"]
    return [name, str(value)]


@pytest.mark.parametrize("parser", PARSERS)
@pytest.mark.parametrize("option", fields(EngineOptions), ids=lambda option: option.name)
def test_every_engine_option_is_a_flag_of_every_mode(option, parser):
    value = another_value(option, getattr(Settings(), option.name))
    settings = settings_from_args(PARSERS[parser]().parse_args(flag_for(option, value)))
    assert getattr(settings.engine_options(), option.name) == value


@pytest.mark.parametrize("option", fields(EngineOptions), ids=lambda option: option.name)
def test_every_engine_option_is_a_config_key_that_the_flags_override(option):
    value = another_value(option, getattr(Settings(), option.name))
    paths.config_file().parent.mkdir(parents=True)
    paths.config_file().write_text(f"{option.name} = {_toml_value(value)}\n")
    assert getattr(load_settings().engine_options(), option.name) == value
    over = another_value(option, value)
    flagged = settings_from_args(cli.build_parser().parse_args(flag_for(option, over)))
    assert getattr(flagged.engine_options(), option.name) == over


def test_short_flags_name_the_same_option():
    parse = cli.build_parser().parse_args
    for option in fields(EngineOptions):
        if option.metadata["flag"]:
            assert getattr(parse([option.metadata["flag"], "3"]), option.name) == 3


def test_every_option_has_a_one_line_doc_and_help():
    help_text = cli.build_parser().format_help()
    for option in fields(EngineOptions):
        assert option.metadata["doc"] and "\n" not in option.metadata["doc"]
        assert f"--{option.name.replace('_', '-')}" in help_text


def test_a_config_file_of_the_old_flat_keys_still_loads():
    paths.config_file().parent.mkdir(parents=True)
    paths.config_file().write_text(
        'model = "demo"\ndevice = "cpu"\ndtype = "bfloat16"\nquantization = "int8"\ntensor_parallel_size = 2\n'
        'max_model_len = 2048\nmax_num_seqs = 16\ngpu_memory_utilization = 0.5\nenforce_eager = true\n'
        'max_prefill_chunk = 128\ntemperature = 0.2\n\n[keys]\nnew_tab = "ctrl+n"\n')
    settings = load_settings()
    assert settings.engine_options() == EngineOptions(
        device="cpu", dtype="bfloat16", quantization="int8", tensor_parallel_size=2, max_model_len=2048,
        max_num_seqs=16, gpu_memory_utilization=0.5, enforce_eager=True, max_prefill_chunk=128,
        disk_cache_dir=str(paths.kv_cache_dir()))
    assert (settings.model, settings.temperature, settings.keys) == ("demo", 0.2, {"new_tab": "ctrl+n"})


def test_the_app_departs_from_the_engines_defaults_in_four_options_only():
    engine, app = EngineOptions(), Settings().engine_options()
    differ = {name: getattr(app, name) for name in OPTION_NAMES if getattr(app, name) != getattr(engine, name)}
    assert differ == {"max_num_seqs": 64, "quantization": "auto", "max_prefill_chunk": 64,
                      "disk_cache_dir": str(paths.kv_cache_dir())}


def test_a_bad_option_in_config_toml_names_the_file_and_the_value():
    paths.config_file().parent.mkdir(parents=True)
    paths.config_file().write_text("gpu_memory_utilization = 1.5\n")
    with pytest.raises(SettingsError, match=r"config\.toml: gpu_memory_utilization must be in \(0, 1\], got 1.5"):
        load_settings()
    paths.config_file().write_text('max_num_seqs = "many"\n')
    with pytest.raises(SettingsError, match="config.toml: max_num_seqs must be an integer, got 'many'"):
        load_settings()


@pytest.mark.parametrize("argv", [["--max-model-len", "0"], ["serve", "--max-model-len", "0"]])
def test_a_bad_option_flag_is_named_before_any_model_loads(argv, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("nvchat.cli.run_tui", lambda settings: pytest.fail("the app started"))
    assert cli.main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["nvchat: max_model_len must be a positive integer, got 0"]


def test_an_unknown_keyword_is_a_type_error_naming_it_and_the_valid_ones(tmp_path):
    for build in (LLM, EngineThread):
        with pytest.raises(TypeError, match="'max_model_length'") as error:
            build(tmp_path / "never-read", max_model_length=512)
        assert all(name in str(error.value) for name in OPTION_NAMES)


def test_the_options_the_flags_give_are_what_the_engine_runs_with(demo_model_path):
    argv = ["--model", str(demo_model_path), "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
            "--max-num-seqs", "3", "--max-num-batched-tokens", "300", "--kvcache-block-size", "8",
            "--num-kvcache-blocks", "40", "--gpu-memory-utilization", "0.5", "--enforce-eager",
            "--attention-backend", "torch", "--max-prefill-chunk", "32", "--no-prefill-cuda-graphs",
            "--quantization", "none", "--no-async-scheduling"]
    settings = settings_from_args(cli.build_parser().parse_args(argv))
    with open_backend(settings) as engine:
        assert engine.llm.options == settings.engine_options()
        config, scheduler = engine.llm.config, engine.llm.scheduler
        assert (config.max_model_len, config.kvcache_block_size, engine.llm.blocks.num_blocks) == (256, 8, 40)
        assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.max_prefill_chunk) == (3, 300, 32)
        assert (config.attention_backend, config.quantization, engine.llm.async_scheduling) == ("torch", None, False)
        assert engine.capabilities.context_length == 256
        stream = engine.submit("Hello", SamplingParams(max_tokens=2, ignore_eos=True))
        assert stream.wait(60) and stream.num_completion_tokens == 2


def test_garbage_collection_is_back_on_once_the_engine_has_started_or_failed_to(demo_model_path, tmp_path):
    """open_backend pauses the collector while torch loads and the model is built (nvchat/backend.py)."""
    assert gc.isenabled()
    settings = Settings(model=str(demo_model_path), device="cpu", max_model_len=64, disk_cache_gib=0)
    with open_backend(settings):
        assert gc.isenabled()
    with pytest.raises(ValueError):
        open_backend(Settings(model=str(tmp_path / "no-such-model"), device="cpu"))
    assert gc.isenabled()
