"""The engine reads a checkpoint's config.json without transformers (ModelConfig): every value it
takes from it equals what transformers' own AutoConfig gives, for full configs, for configs that
leave fields to their defaults, and for the benchmark shapes."""
import json
from pathlib import Path

import pytest
import transformers

from engine.checkpoints.model_config import MODEL_TYPES, ModelConfig
from engine.config import _model_config
from engine.layers.rotary import RotaryEmbedding
from engine.models.qwen3 import rope_settings
from engine.models.registry import ARCHITECTURES

CONFIGS = Path(__file__).resolve().parents[1] / "benchmarks" / "configs"
ARCHITECTURE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step")


def engine_view(config, architecture: str) -> dict:
    """Every value the engine reads from a model config (engine/models, engine/config.py, the EOS ids)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # RoPE as the layers compute it (transformers 5 also copies rope_theta into the scaling dict).
    rope = RotaryEmbedding(head_dim, 64, *rope_settings(config))
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope=(rope.cos.tolist(), rope.sin.tolist()), tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=getattr(config, "attention_bias", ARCHITECTURES[architecture].attention_bias),
        eos_token_id=getattr(config, "eos_token_id", None), bos_token_id=getattr(config, "bos_token_id", None),
        hidden_act=config.hidden_act,
        # Qwen3-MoE's (engine/models/qwen3_moe.py); absent elsewhere.
        **{name: getattr(config, name, None) for name in MOE_FIELDS},
        mlp_only_layers=list(getattr(config, "mlp_only_layers", None) or []))


def both_ways(tmp_path, raw: dict):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours = _model_config(tmp_path, raw)
    assert isinstance(ours, ModelConfig)  # transformers stayed out of it
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    arch = raw["architectures"][0]
    return engine_view(ours, arch), engine_view(theirs, arch)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_config_that_names_only_its_type_gets_transformers_defaults(tmp_path, model_type):
    ours, theirs = both_ways(tmp_path, {"architectures": [ARCHITECTURE[model_type]], "model_type": model_type})
    assert ours == theirs


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_a_config_written_by_transformers_reads_the_same(tmp_path, model_type):
    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}[model_type]
    # transformers writes num_experts as num_local_experts.
    moe = dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True,
               mlp_only_layers=[1]) if model_type == "qwen3_moe" else {}
    config_cls(vocab_size=211, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6,
               num_key_value_heads=2, max_position_embeddings=777, rms_norm_eps=3e-5, tie_word_embeddings=True,
               bos_token_id=5, eos_token_id=[6, 7], architectures=[ARCHITECTURE[model_type]],
               **moe).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    ours, theirs = both_ways(tmp_path, raw)
    assert ours == theirs


@pytest.mark.parametrize("shape", sorted(p.name for p in CONFIGS.iterdir()))
def test_the_benchmark_shapes_read_the_same(tmp_path, shape):
    raw = json.loads((CONFIGS / shape / "config.json").read_text())
    ours, theirs = both_ways(tmp_path, raw)
    assert ours == theirs


@pytest.mark.parametrize("rope", [
    {"rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": 250000.0}},
], ids=["transformers-4-style", "transformers-5-style"])
def test_rope_settings_read_the_same_in_either_transformers_style(tmp_path, rope):
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "num_attention_heads": 4, "max_position_embeddings": 16384, **rope}
    ours, theirs = both_ways(tmp_path, raw)
    assert ours == theirs
    default = ModelConfig("llama", hidden_size=64, num_attention_heads=4)
    assert ours["rope"] != engine_view(default, "LlamaForCausalLM")["rope"]


def test_a_model_type_without_built_in_defaults_goes_through_transformers(tmp_path):
    raw = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    config = _model_config(tmp_path, raw)
    assert isinstance(config, transformers.PretrainedConfig) and config.sliding_window == 64


def test_fields_the_defaults_do_not_list_are_kept():
    config = ModelConfig("qwen3", quantization_config={"quant_method": "fp8"}, num_attention_heads=8)
    assert config.quantization_config == {"quant_method": "fp8"} and config.num_key_value_heads == 8
