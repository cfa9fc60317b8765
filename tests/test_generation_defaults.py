"""The sampling values a checkpoint recommends, and how the app's settings use them: a value set in
config.toml or by a flag first, then the model's recommendation, then nvchat's fallback."""
import json

import pytest

from engine.checkpoints.generation_defaults import recommended_sampling
from nvchat.settings import FALLBACK_SAMPLING, Settings, SettingsError, load_settings
from tests.gguf_files import SHAPE, _add_metadata, tokenizer_tokens


def test_generation_config_recommendations_are_read_and_bad_ones_left_out(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20.0, "repetition_penalty": 0,
         "min_p": 0.05, "eos_token_id": [1, 2]}))
    assert recommended_sampling(tmp_path) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05}


def test_a_generation_config_that_does_not_sample_recommends_nothing(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6}))
    assert recommended_sampling(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert recommended_sampling(tmp_path) == {}


def test_gguf_sampling_metadata_is_read(tmp_path):
    import gguf
    import transformers
    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    _add_metadata(w, "llama", transformers.LlamaConfig(**SHAPE, vocab_size=len(tokenizer_tokens())), "gpt2")
    w.add_float32("general.sampling.temp", 0.5)
    w.add_int32("general.sampling.top_k", 40)
    w.add_float32("general.sampling.top_p", 1.5)  # out of range: left out
    w.add_float32("general.sampling.penalty_repeat", 1.25)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert recommended_sampling(path) == {"temperature": 0.5, "top_k": 40, "repetition_penalty": 1.25}


def test_a_setting_beats_the_models_recommendation_which_beats_the_fallback():
    recommended = {"temperature": 0.3, "top_k": 50, "repetition_penalty": 1.3}
    values = Settings(top_k=5).sampling_defaults(recommended)
    assert values == {**FALLBACK_SAMPLING, "temperature": 0.3, "top_k": 5, "repetition_penalty": 1.3,
                      "max_tokens": 1024}
    assert Settings().sampling_defaults() == {**FALLBACK_SAMPLING, "max_tokens": 1024}
    params = Settings().sampling_params(recommended, temperature=0.0)
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.0, 50, 1.3)


def test_penalties_in_config_toml_are_checked(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("repetition_penalty = 1.2\npresence_penalty = 0.5\nmin_p = 0.05\n")
    assert load_settings(path).sampling_params().repetition_penalty == 1.2
    path.write_text('repetition_penalty = "high"\n')
    with pytest.raises(SettingsError, match="repetition_penalty must be"):
        load_settings(path)
