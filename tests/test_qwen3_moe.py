"""Qwen3-MoE on CPU: greedy completions equal HF transformers' own Qwen3MoeForCausalLM token for
token in float32, with the router's top-2 renormalized or not (norm_topk_prob), batched, through
prefix-cache hits, chunked prefill and preemption, over two tensor-parallel ranks (gloo), with a
dense layer among the sparse ones, and from a qwen3moe GGUF file as HF reads it. A checkpoint
missing an expert is refused by name."""
import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.checkpoints.errors import ModelError
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf_model

NEW_TOKENS = 20
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def completions(llm, prompts, params=GREEDY):
    return [o["token_ids"] for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def moe_without_renormalization(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-moe-plain")
    save_tiny_hf_model(path, tie=True, arch="qwen3_moe", seed=3, norm_topk_prob=False)
    return path


@pytest.mark.parametrize("fixture", ["tiny_qwen3_moe", "moe_without_renormalization"])
def test_greedy_matches_hf_batched(request, fixture):
    path = request.getfixturevalue(fixture)
    prompts = random_prompts([1, 7, 16, 17, 33, 64], seed=4)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    with LLM(path, device="cpu", kvcache_block_size=4) as llm:
        assert type(llm.runner.model).__name__ == "Qwen3MoeForCausalLM"
        assert llm.runner.model.model.layers[0].mlp.renormalize == (fixture == "tiny_qwen3_moe")
        assert completions(llm, prompts) == expected
        assert llm.stats().num_free_blocks == llm.stats().num_blocks


def test_prefix_hits_chunked_prefill_and_preemption_match_hf(tiny_qwen3_moe):
    """Prompts sharing a 40-token prefix in one call (its blocks reused), prefilled 13 tokens a
    step beside other sequences' decodes, in a cache too small for all of them (preempted)."""
    shared = random_prompts([40], seed=8)[0]
    prompts = [shared + own for own in random_prompts([3, 9, 21], seed=9)] + random_prompts([30, 12], seed=10)
    expected = hf_greedy(tiny_qwen3_moe, prompts, NEW_TOKENS)
    with LLM(tiny_qwen3_moe, device="cpu", kvcache_block_size=4, num_kvcache_blocks=36, max_num_batched_tokens=24,
             max_prefill_chunk=13) as llm:
        assert completions(llm, prompts) == expected
        stats = llm.stats()
        assert stats.prefix_hit_tokens >= 2 * 40
        assert stats.num_preemptions > 0
        assert stats.num_free_blocks == stats.num_blocks


def test_two_tensor_parallel_ranks_split_the_experts_and_match_hf(tiny_qwen3_moe):
    prompts = random_prompts([5, 18, 33], seed=11)
    prompts.append(prompts[-1][:24] + [7, 8, 9])  # a prefix hit on both ranks
    expected = hf_greedy(tiny_qwen3_moe, prompts, NEW_TOKENS)
    with LLM(tiny_qwen3_moe, device="cpu", kvcache_block_size=4, tensor_parallel_size=2) as llm:
        experts = llm.runner.runner.model.model.layers[0].mlp.experts
        assert tuple(experts.w13.shape) == (8, 2 * 16, 64) and tuple(experts.w2.shape) == (8, 64, 16)
        assert completions(llm, prompts) == expected
        assert llm.stats().prefix_hit_tokens == 24


def test_dense_layers_among_sparse_ones_match_hf(tmp_path):
    """mlp_only_layers keeps layer 1 a dense SwiGLU MLP (intermediate_size), as HF builds it."""
    save_tiny_hf_model(tmp_path, tie=False, arch="qwen3_moe", seed=4, mlp_only_layers=[1])
    prompts = random_prompts([6, 25], seed=12)
    expected = hf_greedy(tmp_path, prompts, 12)
    with LLM(tmp_path, device="cpu", kvcache_block_size=8) as llm:
        layers = llm.runner.model.model.layers
        assert [type(layer.mlp).__name__ for layer in layers] == ["SparseMoeBlock", "MLP"]
        assert completions(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) == expected


def test_qwen3moe_gguf_matches_hf_reading_the_same_file(tmp_path, monkeypatch):
    """A qwen3moe file as llama.cpp's converter lays it out: the experts stacked per layer
    (ffn_gate_exps, ffn_up_exps, ffn_down_exps, in Q8_0, F16 and Q4_0), the router as
    ffn_gate_inp, the expert count, top-k and width in the metadata."""
    from tests.gguf_files import hf_gguf_greedy, tokenizer_tokens, write_tiny_gguf
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny-qwen3moe.gguf", arch="qwen3_moe", seed=6)
    prompts = random_prompts([3, 17, 40], vocab=len(tokenizer_tokens()), seed=5)
    expected = hf_gguf_greedy(path, prompts, 12)
    with LLM(str(path), device="cpu", kvcache_block_size=8) as llm:
        config = llm.config.hf_config
        assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size) == (4, 2, 768)
        assert config.norm_topk_prob
        assert completions(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) == expected


def test_a_checkpoint_missing_an_expert_is_named(tmp_path, tiny_qwen3_moe):
    tensors = load_file(tiny_qwen3_moe / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.6.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_bytes((tiny_qwen3_moe / "config.json").read_bytes())
    with pytest.raises(ModelError, match=r"lacks weights: model\.layers\.1\.mlp\.experts\.6\.up_proj\.weight$"):
        LLM(tmp_path, device="cpu")
