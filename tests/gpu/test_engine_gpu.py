"""Engine-level checks on a CUDA device: skipped without one."""
import pytest
import torch

from benchmarks.bench_memory import peak_use
from benchmarks.common import CONFIGS
from engine import LLM, SamplingParams
from engine.runner.model_runner import _TokenReadback
from tests.conftest import hf_greedy, random_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("block_size", [16, 64, 256])
def test_triton_backend_with_cuda_graphs_matches_hf_in_float32(tiny_qwen3, block_size):
    prompts = random_prompts([1, 15, 16, 17, 100, 300], seed=block_size)
    expected = hf_greedy(tiny_qwen3, prompts, 24)
    with LLM(tiny_qwen3, device="cuda", dtype="float32", kvcache_block_size=block_size, max_model_len=512,
             max_num_seqs=8, gpu_memory_utilization=0.3) as llm:
        assert llm.runner.decode_graphs is not None
        outs = llm.generate(prompts, GREEDY)
    assert [o["token_ids"] for o in outs] == expected


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
def test_chat_sized_batches_match_hf_in_float32_with_graphs_and_eagerly(tiny_qwen3, batch):
    """1-8 streams decoding together run the Triton GEMV's row kernels (padded to a graph's bucket
    with graphs, at their own count eagerly)."""
    prompts = random_prompts([5 + 11 * i for i in range(batch)], seed=100 + batch)
    expected = hf_greedy(tiny_qwen3, prompts, 24)
    for eager in (False, True):
        with LLM(tiny_qwen3, device="cuda", dtype="float32", enforce_eager=eager, max_model_len=512,
                 max_num_seqs=8, gpu_memory_utilization=0.3) as llm:
            assert (llm.runner.decode_graphs is None) == eager
            outs = llm.generate(prompts, GREEDY)
        assert [o["token_ids"] for o in outs] == expected, f"enforce_eager={eager}"


def test_cuda_graphs_match_eager(tiny_qwen3):
    """Decode graphs, and prefill graphs for small and mixed steps: chunked prompts mixed into
    decoding, and a second round that hits the prefix cache."""
    shared = random_prompts([70], seed=2)[0]
    prompts = random_prompts([5, 33, 70, 129], seed=3) + [shared + [1, 2, 3]]
    runs = []
    for eager in (True, False):
        with LLM(tiny_qwen3, device="cuda", dtype="float32", enforce_eager=eager, max_model_len=512,
                 max_num_seqs=8, max_prefill_chunk=48, gpu_memory_utilization=0.3, prefill_cuda_graphs=True) as llm:
            if not eager:
                assert llm.runner.prefill_graphs is not None
            first = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
            second = [o["token_ids"] for o in llm.generate([shared + [9], shared + [4, 5]], GREEDY)]
            assert llm.stats().prefix_hit_tokens > 0
            runs.append((first, second))
    assert runs[0] == runs[1]


def test_sampling_graphs_draw_within_the_settings_and_afresh_each_replay(tiny_qwen3):
    """The captured sampling: top_k=1 and a tiny temperature must give the greedy tokens, through
    the filtering and plain sampling graphs, beside greedy rows; identical unseeded requests must
    differ (the graph's noise is new every replay); seeded ones (sampled outside the graphs) must
    repeat."""
    prompts = random_prompts([7, 20, 33, 12, 5, 40], seed=8)
    force = [SamplingParams(temperature=0.8, top_k=1, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1e-4, max_tokens=24, ignore_eos=True), GREEDY]
    with LLM(tiny_qwen3, device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
             gpu_memory_utilization=0.3) as llm:
        graphs = llm.runner.decode_graphs
        assert {kind for _, kind in graphs.sample_graphs} == {"greedy", "sample", "filter"}
        greedy = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
        forced = [o["token_ids"] for o in llm.generate(prompts, [force[i % 3] for i in range(len(prompts))])]
        assert forced == greedy
        free = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True)
        draws = [o["token_ids"] for o in llm.generate([prompts[0]] * 4, free)]
        assert len({tuple(d) for d in draws}) > 1
        seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=24, ignore_eos=True, seed=3)
        repeats = [o["token_ids"] for o in llm.generate([prompts[1]] * 3, seeded)]
        assert repeats[0] == repeats[1] == repeats[2]


def test_torch_backend_on_cuda_matches_triton(tiny_qwen3):
    prompts = random_prompts([9, 40, 77], seed=4)
    runs = []
    for backend in ("torch", "triton"):
        with LLM(tiny_qwen3, device="cuda", dtype="float32", attention_backend=backend, enforce_eager=True,
                 max_model_len=512, max_num_seqs=8, gpu_memory_utilization=0.3) as llm:
            runs.append([o["token_ids"] for o in llm.generate(prompts, GREEDY)])
    assert runs[0] == runs[1]


def test_preemption_on_gpu(tiny_qwen3):
    prompts = random_prompts([60, 50, 70, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(tiny_qwen3, device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
             gpu_memory_utilization=0.3) as roomy:
        expected = [o["token_ids"] for o in roomy.generate(prompts, params)]
    with LLM(tiny_qwen3, device="cuda", dtype="float32", max_model_len=512, max_num_seqs=8,
             num_kvcache_blocks=20) as tight:
        outs = tight.generate(prompts, params)
        assert tight.stats().num_preemptions > 0
    assert [o["token_ids"] for o in outs] == expected


@pytest.mark.parametrize("shape, utilization", [("qwen3-0.6b", 0.4), ("qwen3-0.6b", 0.9), ("qwen3-8b", 0.4),
                                                ("qwen3-8b", 0.9)])
def test_the_costliest_steps_stay_within_gpu_memory_utilization(shape, utilization):
    """A small model with a large vocabulary: sampling 256 rows with top-k/top-p sorts more bytes
    than its prefill needs, which the KV cache's sizing once left out. And an 8B model, whose
    prefill needs more."""
    with LLM(str(CONFIGS / shape), load_format="random", dtype="bfloat16", max_model_len=2048,
             max_num_seqs=256, gpu_memory_utilization=utilization) as llm:
        plan = llm.runner.memory_plan
        assert plan["activations"] > 0 and plan["graph_pool"] > 0
        use = peak_use(llm, 256, 2048)
    over = (use["peak"] - use["budget"]) / 2**30
    print(f"{shape} at {utilization}: peak {use['peak'] / 2**30:.3f} GiB, {-over:.3f} GiB within the budget; {plan}")
    assert over <= 0, f"peak {over:.3f} GiB past the budget; set aside: {plan}"


def test_reading_tokens_after_a_later_step_reused_their_buffer_raises():
    readback = _TokenReadback(4)
    tokens = torch.arange(4, device="cuda")
    first, second = readback.queue(tokens), readback.queue(tokens + 10)
    assert first.tolist() == [0, 1, 2, 3]
    third = readback.queue(tokens + 20)
    with pytest.raises(RuntimeError, match="reused their buffer"):
        first.tolist()
    assert second.tolist() == [10, 11, 12, 13] and third.tolist() == [20, 21, 22, 23]


def test_quantization_on_cuda_is_refused_by_name(tiny_qwen3):
    with pytest.raises(ValueError, match="quantization='int4' runs on CPU only"):
        LLM(tiny_qwen3, device="cuda", quantization="int4")
