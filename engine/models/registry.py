"""The architectures the engine runs, by the name a checkpoint's config.json gives them."""
from engine.models.qwen3 import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from engine.models.qwen3_moe import Qwen3MoeForCausalLM

ARCHITECTURES = {cls.__name__: cls for cls in (Qwen3ForCausalLM, Qwen3MoeForCausalLM, Qwen2ForCausalLM,
                                               LlamaForCausalLM)}
