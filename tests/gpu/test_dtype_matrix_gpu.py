"""Every dtype the engine takes, at hidden sizes and head dims across the range it serves, through
both attention backends, with CUDA graphs and eagerly, against HF transformers on the same GPU.

Models: tiny random Qwen3s written by transformers' save_pretrained, in real models' layer shapes,
the two ends of the range the engine serves (Qwen3-0.6B's own shapes run in the kernel tests):
  h576   hidden 576, 9 query / 3 KV heads of 64 (SmolLM2-135M's), 2 layers, vocab 2560, tied
  h5120  hidden 5120, 40 / 8 heads of 128 (Qwen3-14B's: a GQA group of 5), 1 layer, vocab 512
Their projections take every GEMV launch shape (weights of up to 2048 rows, of 2049-4096, of more;
an LM head of either size). Weights are drawn at 4 / sqrt(hidden), so logits spread ~4 apart and
float16 activations stay far from overflow at both widths.

Engines, for each model and dtype: the Triton backend with CUDA graphs (the default), and one of
Triton eager, torch with CUDA graphs (decode steps; its prefill is never captured) and torch
eager, in turn, so that each model meets all four and each dtype three (float32's torch eager
runs in test_engine_gpu.py). Each Triton (model, dtype) compiles its own
kernels: ~20 of them, most of this module's time on a cold Triton cache.

Steps: three prompts (1, 40 and 150 tokens: one prefill step past the small-step tiles), then
three more (15, 17 and 90) after three steps, prefilled in chunks of at most 48 beside the first
three decoding; the batch grows to 6 rows and shrinks to 1 as they finish. With CUDA graphs the
captured sampling (top-k and temperature graphs) runs too.

What is asserted:
- float32: every greedy token is HF float32's, token for token.
- float16 and bfloat16: no engine can promise HF float32's tokens there (a near-tie flips with
  rounding, and the contexts part). So each token the engine picks is judged by HF float32's
  logits for the engine's own context (teacher-forced): it may fall short of the best logit by
  at most 4x the largest rounding error HF itself makes in that dtype on the same contexts (its
  logits against its float32 ones). An engine whose logits were as close as HF's could fall short
  by 2x; the other 2x is room for different summation orders. A wrong kernel (a K/V slot, a head,
  a position, a tile's rows) falls short by whole logits, tens of times that. How close the tokens
  come to HF float32's greedy ones is printed (pytest -s).

Run (one GPU; skipped without one):
    PYTHONPATH=$PWD python -m pytest -q -s tests/gpu/test_dtype_matrix_gpu.py
"""
import math

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import random_prompts, save_tiny_hf_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SHAPES = {
    "h576": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                 num_hidden_layers=2, vocab_size=2560, tie=True),
    "h5120": dict(hidden_size=5120, intermediate_size=4096, num_attention_heads=40, num_key_value_heads=8,
                  head_dim=128, num_hidden_layers=1, vocab_size=512, tie=False),
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (backend, enforce_eager) beside Triton with graphs, taken in turn by (model, dtype).
SECONDARY = [("triton", True), ("torch", False), ("torch", True)]
CASES = [(model, dtype, "triton", False) for model in SHAPES for dtype in DTYPES] + \
        [(model, dtype, *SECONDARY[(i + j) % 3]) for i, model in enumerate(SHAPES) for j, dtype in enumerate(DTYPES)]

FIRST_WAVE, SECOND_WAVE = [1, 40, 150], [15, 17, 90]
MAX_TOKENS = [24, 20, 8, 16, 24, 12]
DEVICE = "cuda"
ENGINE = dict(device=DEVICE, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512, max_prefill_chunk=48,
              num_kvcache_blocks=128)
# An engine's float16/bfloat16 logits may err by this many times HF's own rounding error (see above).
ROUNDING_ROOM = 4.0


class Reference:
    """A model's checkpoint, its prompts, and HF on the GPU: float32 (and each dtype, on demand)."""

    def __init__(self, name: str, path):
        shape = dict(SHAPES[name])
        tie = shape.pop("tie")
        self.name, self.path = name, path
        model = save_tiny_hf_model(path, tie=tie, initializer_range=4 / math.sqrt(shape["hidden_size"]),
                                   max_position_embeddings=1024, **shape)
        self.hf = {torch.float32: model.to(DEVICE)}
        self.prompts = random_prompts(FIRST_WAVE + SECOND_WAVE, vocab=shape["vocab_size"], seed=len(name))
        self.greedy = self._greedy(max(MAX_TOKENS))

    def model(self, dtype: torch.dtype):
        if dtype not in self.hf:
            import transformers  # optional here: only the half-precision cases load a second copy
            self.hf[dtype] = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype).to(DEVICE).eval()
        return self.hf[dtype]

    @torch.no_grad()
    def _greedy(self, new_tokens: int) -> list[list[int]]:
        out = []
        for p in self.prompts:
            ids = torch.tensor([p], device=DEVICE)
            gen = self.hf[torch.float32].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                  pad_token_id=0, eos_token_id=None)
            out.append(gen[0, len(p):].tolist())
        return out

    @torch.no_grad()
    def logits(self, dtype: torch.dtype, prompt: list[int], tokens: list[int]) -> torch.Tensor:
        """float32 logits of the positions that predict `tokens` after `prompt`, teacher-forced."""
        ids = torch.tensor([prompt + tokens], device=DEVICE)
        return self.model(dtype)(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)].float()


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    # The reference runs at float32's full precision: TF32 matmuls would make it a worse oracle.
    assert not torch.backends.cuda.matmul.allow_tf32
    made = {}

    def get(name: str) -> Reference:
        if name not in made:
            made[name] = Reference(name, tmp_path_factory.mktemp(name))
        return made[name]
    yield get
    made.clear()
    torch.cuda.empty_cache()


def run_in_two_waves(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    first = len(FIRST_WAVE)
    seqs = [llm.add_request(p, sp) for p, sp in zip(prompts[:first], params[:first])]
    for _ in range(3):
        llm.step()
    seqs += [llm.add_request(p, sp) for p, sp in zip(prompts[first:], params[first:])]
    while llm.has_unfinished():
        llm.step()
    return [s.completion_token_ids for s in seqs]


def agreement(tokens: list[list[int]], greedy: list[list[int]]) -> str:
    """How far each completion follows HF float32's greedy one."""
    prefix = [next((i for i, (a, b) in enumerate(zip(t, g)) if a != b), len(t)) for t, g in zip(tokens, greedy)]
    whole = sum(p == len(t) for p, t in zip(prefix, tokens))
    return f"{whole}/{len(tokens)} completions equal HF float32's; tokens before the first difference {prefix}"


def check_sampling_graphs(llm: LLM, ref: Reference, greedy: list[list[int]], dtype: str, case: str) -> None:
    """The captured sampling in this dtype, "narrow_filter" (a top-k of 1) and "sample" graphs: a top-k of 1 and
    a near-zero temperature pick the greedy tokens (at 1e-6 a logit 1e-4 below the best keeps
    e^-100 of its probability). Exactly so in float32; in half precision two logits can round to
    the same value, and then a draw may take either, so there the tokens are only checked to be
    tokens."""
    for forced in (SamplingParams(temperature=0.8, top_k=1, max_tokens=8, ignore_eos=True),
                   SamplingParams(temperature=1e-6, max_tokens=8, ignore_eos=True)):
        drawn = [o["token_ids"] for o in llm.generate(ref.prompts[:2], forced)]
        if dtype == "float32":
            assert drawn == [g[:8] for g in greedy[:2]], f"{case}: {forced} drew {drawn}, greedy {greedy[:2]}"
        else:
            vocab = SHAPES[ref.name]["vocab_size"]
            assert all(len(d) == 8 and all(0 <= t < vocab for t in d) for d in drawn), f"{case}: {forced} drew {drawn}"


@pytest.mark.parametrize("model, dtype, backend, eager", CASES,
                         ids=[f"{m}-{d}-{b}-{'eager' if e else 'graphs'}" for m, d, b, e in CASES])
def test_greedy_decoding_agrees_with_hf(references, model, dtype, backend, eager):
    ref = references(model)
    case = f"{model} ({SHAPES[model]['hidden_size']} hidden, head_dim {SHAPES[model]['head_dim']}) {dtype} " \
           f"{backend} {'eager' if eager else 'with CUDA graphs'}"
    with LLM(str(ref.path), dtype=dtype, attention_backend=backend, enforce_eager=eager, **ENGINE) as llm:
        assert (llm.runner.decode_graphs is None) == eager, case
        assert (llm.runner.prefill_graphs is None) == (eager or backend == "torch"), case
        tokens = run_in_two_waves(llm, ref.prompts)
        if not eager:
            check_sampling_graphs(llm, ref, tokens, dtype, case)
    assert [len(t) for t in tokens] == MAX_TOKENS, case
    greedy = [g[:n] for g, n in zip(ref.greedy, MAX_TOKENS)]
    print(f"\n{case}: {agreement(tokens, greedy)}")
    if dtype == "float32":
        for i, (got, want) in enumerate(zip(tokens, greedy)):
            if got != want:
                at = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
                logits = ref.logits(torch.float32, ref.prompts[i], want)[at]
                top2 = logits.topk(2).values
                pytest.fail(f"{case}: prompt {i} ({len(ref.prompts[i])} tokens) left HF float32's greedy tokens at "
                            f"token {at}: {got[at]} for {want[at]} (HF's margin there: {top2[0] - top2[1]:.2e})")
        return
    low = DTYPES[dtype]
    worst, hf_error = 0.0, 0.0
    for i, (prompt, got) in enumerate(zip(ref.prompts, tokens)):
        exact = ref.logits(torch.float32, prompt, got)
        hf_error = max(hf_error, (ref.logits(low, prompt, got) - exact).abs().max().item())
        shortfall = exact.max(-1).values - exact.gather(1, torch.tensor(got, device=DEVICE)[:, None])[:, 0]
        if shortfall.max().item() > worst:
            worst, worst_at = shortfall.max().item(), (i, int(shortfall.argmax()))
    bound = ROUNDING_ROOM * hf_error
    print(f"{case}: HF's own {dtype} logits err by {hf_error:.3g}; the engine's picks fall short of HF float32's "
          f"best by {worst:.3g} at most (bound {bound:.3g}); logits spread {exact.std().item():.2f}")
    assert worst <= bound, f"{case}: prompt {worst_at[0]} token {worst_at[1]} falls {worst:.3g} short of HF float32's " \
                           f"best logit; HF's own {dtype} rounding errs by {hf_error:.3g} (bound {bound:.3g})"
