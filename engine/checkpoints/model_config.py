"""A model's config without transformers: config.json's fields (or a GGUF file's metadata) as
attributes, with the defaults transformers' config class for the model type gives the fields the
engine reads. Importing transformers' config classes cost ~4 s of CPU at every start on the 2-core
box (they pull in its activations, hub kernels and torch.distributed.tensor); a model type not listed
here is still read through transformers' AutoConfig (EngineConfig.create).
tests/test_model_config.py checks these defaults against transformers' own classes."""
# Per model type, what transformers' config class assumes for a field config.json leaves out.
# head_dim is left out where the class derives it (hidden_size / heads; the engine does the same).
_DEFAULTS = {
    "llama": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, attention_bias=False, bos_token_id=1, eos_token_id=2, hidden_act="silu"),
    "qwen2": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, hidden_act="silu"),
    "qwen3": dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                  num_attention_heads=32, head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, bos_token_id=None,
                  eos_token_id=None, hidden_act="silu"),
    "qwen3_moe": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=32768,
                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
                      bos_token_id=None, eos_token_id=None, hidden_act="silu", num_experts=128,
                      num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=()),
}
MODEL_TYPES = tuple(_DEFAULTS)
# Fields transformers writes under another name than the engine reads (its config class's attribute_map).
_ALIASES = {"qwen3_moe": {"num_local_experts": "num_experts"}}
# A GGUF file's general.architecture, as the model type it stands for.
GGUF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe"}


class ModelConfig:
    """Every field given, as an attribute (so a field only some architectures read is there when
    the file has it), over the model type's defaults."""

    def __init__(self, model_type: str, **fields):
        if model_type not in _DEFAULTS:
            raise ValueError(f"no built-in defaults for model type {model_type!r}")
        for written, read in _ALIASES.get(model_type, {}).items():
            if written in fields:
                fields[read] = fields.pop(written)
        values = {**_DEFAULTS[model_type], **fields, "model_type": model_type}
        if values.get("num_key_value_heads") is None:
            values["num_key_value_heads"] = values["num_attention_heads"]
        if values.get("head_dim") is None:
            values.pop("head_dim", None)
        self.__dict__.update(values)

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def __eq__(self, other):
        return isinstance(other, ModelConfig) and self.__dict__ == other.__dict__

    def __repr__(self):
        return f"ModelConfig({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items())})"
