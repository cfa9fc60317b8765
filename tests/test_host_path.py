"""The per-step host path: packed step inputs, the sampler's shortcuts, and plan_step's flags."""
import random
from array import array

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.step_plan import StepPlan, plan_step
from engine.runner.sampler import _SEED_MIX, Sampler, filter_top_k_top_p
from tests.conftest import random_prompts


def reference_sample(logits, params, positions, generator):
    """The sampler as it was before its shortcuts: everything in float32, greedy argmax always."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    if all(p.greedy for p in params):
        return greedy.tolist()
    logits = logits / torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])[:, None]
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        logits = filter_top_k_top_p(logits, torch.tensor([p.top_k for p in params]),
                                    torch.tensor([p.top_p for p in params]))
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs).exponential_()
    for row, (p, pos) in enumerate(zip(params, positions)):
        if p.seed is not None and not p.greedy:
            generator.manual_seed((p.seed * _SEED_MIX + pos) % (2**63))
            noise[row].exponential_(generator=generator)
    sampled = (probs / noise).argmax(-1)
    return torch.where(torch.tensor([p.greedy for p in params]), greedy, sampled).tolist()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_argmax_in_model_dtype_matches_float32(dtype, device):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(64, 1000, generator=g) * 4).to(device, dtype)
    # Ties, which bf16's 8-bit mantissa makes common: the first index must win, as in float32.
    logits[0, [7, 300, 999]] = 50.0
    logits[1, :] = 1.0
    logits[2, [0, 999]] = 60.0
    logits[3, 500:] = 70.0
    params = [SamplingParams(temperature=0)] * 64
    tokens = Sampler(torch.device(device))(logits, params, list(range(64))).tolist()
    assert tokens == logits.float().argmax(-1).tolist()
    assert tokens[:4] == [7, 0, 0, 500]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sampled_rows_match_the_float32_reference(dtype):
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(6, 300, generator=g) * 3).to(dtype)
    params = [SamplingParams(temperature=0.7), SamplingParams(temperature=0),
              SamplingParams(temperature=1.3, seed=5), SamplingParams(temperature=0.9, top_k=20),
              SamplingParams(temperature=1.0, top_p=0.8, seed=9), SamplingParams(temperature=0)]
    positions = [11, 12, 13, 14, 15, 16]
    for all_sampled in (False, True):
        ps = [p if not p.greedy or not all_sampled else SamplingParams(temperature=0.5) for p in params]
        torch.manual_seed(123)
        got = Sampler(torch.device("cpu"))(logits, ps, positions).tolist()
        torch.manual_seed(123)
        want = reference_sample(logits, ps, positions, torch.Generator())
        assert got == want


def test_sampler_reuses_row_settings_only_while_they_hold():
    """The sampler keeps the last batch's settings on the device: every change of rows, values
    (a SamplingParams changed in place included) or vocabulary must still sample as a new sampler,
    which builds them afresh, does from the same random state."""
    sampler = Sampler(torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    shared = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)
    batches = [[shared] * 4, [shared] * 4, [shared] * 3, [shared, SamplingParams(temperature=0)] * 2,
               [SamplingParams(temperature=1.1, top_p=0.5)] * 4, [shared] * 4, "mutate", [shared] * 4]
    for vocab, batch in [(300, b) for b in batches] + [(150, [shared] * 4), (300, [shared] * 4)]:
        if batch == "mutate":
            shared.top_k, shared.temperature = 3, 1.5
            continue
        for _ in range(3):
            logits = torch.randn(len(batch), vocab, generator=g) * 3
            positions = list(range(len(batch)))
            torch.manual_seed(7)
            got = sampler(logits, batch, positions).tolist()
            torch.manual_seed(7)
            assert got == Sampler(torch.device("cpu"))(logits, batch, positions).tolist(), (batch, vocab)


def test_packed_inputs_match_the_plan(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", max_model_len=256, num_kvcache_blocks=64, kvcache_block_size=16) as llm:
        runner = llm.runner
        # A prompt chunk that samples nothing, one that does, and a decode row; one table is a
        # plain list, as the runner's warm-up plan passes them.
        plan = StepPlan(input_ids=[5, 6, 7, 8, 9, 10, 11], positions=[0, 1, 2, 16, 17, 40, 3],
                        slot_mapping=[32, 33, 34, 48, 49, 72, 51], cu_seqlens_q=[0, 3, 5, 6],
                        context_lens=[3, 18, 41], block_tables=[[2], [3, 4], [1, 9, 4]], sample_rows=[4, 5],
                        sample_params=[], is_decode=False)
        plan.block_tables[1] = array("i", plan.block_tables[1])
        t = runner._step_inputs(plan)
        assert t["input_ids"].dtype == t["positions"].dtype == t["slot_mapping"].dtype == torch.int64
        assert t["sample_rows"].dtype == torch.int64
        assert t["context_lens"].dtype == t["cu_seqlens_q"].dtype == t["block_tables"].dtype == torch.int32
        for name in ("input_ids", "positions", "slot_mapping", "sample_rows", "context_lens", "cu_seqlens_q"):
            assert t[name].tolist() == list(getattr(plan, name)), name
        assert t["block_tables"].tolist() == [[2, 0, 0], [3, 4, 0], [1, 9, 4]]
        assert "attention_order" not in t and runner.metadata(plan, t).seq_order is None
        base = t["input_ids"].data_ptr()
        assert all((x.data_ptr() - base) % 16 == 0 for x in t.values())  # as separate allocations are
        empty = runner._step_inputs(StepPlan([1], [0], [0], [0, 1], [1], [[0]], [], [], is_decode=True))
        assert empty["sample_rows"].numel() == 0 and empty["input_ids"].tolist() == [1]
        # A decode step's attention starts its sequences longest context first, ties in row order.
        decode = StepPlan([1, 2, 3, 4], [9, 30, 4, 30], [9, 30, 4, 30], [0, 1, 2, 3, 4], [10, 31, 5, 31],
                          [[0], [1, 2], [3], [4, 5]], [0, 1, 2, 3], [], is_decode=True)
        t = runner._step_inputs(decode)
        assert t["attention_order"].dtype == torch.int32 and t["attention_order"].tolist() == [1, 3, 0, 2]
        assert runner.metadata(decode, t).seq_order is t["attention_order"]


def test_plan_flags_decode_steps(tiny_qwen3):
    with LLM(tiny_qwen3, device="cpu", max_model_len=256) as llm:
        seqs = [llm.add_request(list(range(1, 20)), SamplingParams(temperature=0, max_tokens=8)) for _ in range(3)]
        batch, _ = llm.scheduler.schedule()
        plan = plan_step(batch, llm.block_size)
        assert not plan.is_decode and plan.max_seqlen_q == 19
        for seq, n in batch:
            seq.num_computed_tokens += n
            seq.token_ids.append(1)
        batch, _ = llm.scheduler.schedule()
        plan = plan_step(batch, llm.block_size)
        assert plan.is_decode and plan.max_seqlen_q == 1 and plan.sample_rows == [0, 1, 2]
        assert len(seqs) == plan.num_seqs


def test_bf16_engine_greedy_matches_float32_argmax_of_its_logits(tiny_qwen3):
    """End to end in bf16: the engine's tokens are the float32 argmax of the logits it computed."""
    with LLM(tiny_qwen3, device="cpu", dtype="bfloat16", max_model_len=256) as llm:
        seen = []
        compute = llm.runner.model.compute_logits

        def spy(hidden):
            logits = compute(hidden)
            seen.append(logits.float().argmax(-1).tolist())
            return logits
        llm.runner.model.compute_logits = spy
        out = llm.generate([list(range(1, 30)), list(range(40, 47))],
                           SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert [o["token_ids"] for o in out] == [[step[0] for step in seen], [step[1] for step in seen]]


def test_logits_for_a_padded_row_count_give_the_same_tokens(tiny_qwen3):
    """On CUDA the logits are taken for a row count from a warmed ladder (ModelRunner.logits_rows):
    decode steps of 3 rows compute 4, a chunk beside decodes gathers its sampled rows padded with
    repeats. Padding rows must never reach the sampler."""
    prompts = random_prompts([30, 5, 17, 9, 41], seed=31)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 3)] + \
             [SamplingParams(temperature=0.9, top_k=20, max_tokens=n, ignore_eos=True, seed=n) for n in (7, 9, 5)]
    ladder = [1, 2, 4, 8, 16]
    outs = []
    for padded in (False, True):
        with LLM(tiny_qwen3, device="cpu", max_prefill_chunk=16, max_num_batched_tokens=32) as llm:
            llm.runner._logits_ladder = ladder if padded else None
            model, logits_rows, sampled_rows = llm.runner.model, [], []
            compute_logits, sampler = model.compute_logits, llm.runner.sampler
            sample = sampler.sample

            def logits_spy(hidden):
                logits_rows.append(hidden.shape[0])
                return compute_logits(hidden)

            def sampler_spy(logits, *args):
                sampled_rows.append(logits.shape[0])
                return sample(logits, *args)
            model.compute_logits, sampler.sample = logits_spy, sampler_spy
            outs.append([o["token_ids"] for o in llm.generate(prompts, params)])
        if padded:
            assert set(logits_rows) <= set(ladder)
            assert [llm.runner.logits_rows(n) for n in sampled_rows] == logits_rows
            assert any(n not in ladder for n in sampled_rows)  # some steps really were padded
        else:
            assert logits_rows == sampled_rows
    assert outs[0] == outs[1]


def test_text_decoder_matches_tokenizer_decode(demo_model_path):
    """The detokenizer's direct backend decode gives tokenizer.decode's text: special and added
    tokens, broken UTF-8, empty input; with clean-up on it is tokenizer.decode itself."""
    from transformers import AutoTokenizer

    from engine.text.detokenizer import text_decoder
    tok = AutoTokenizer.from_pretrained(demo_model_path)
    decode = text_decoder(tok)
    assert decode.func.__self__ is tok.backend_tokenizer  # the fast path, not a wrapper
    rng = random.Random(0)
    cases = [[], [len(tok) - 1], tok.encode("naïve 🎉 <|im_end|> <think> x"), tok.encode("🎉")[:2]]
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 12))] for _ in range(300)]
    for ids in cases:
        assert decode(ids) == tok.decode(ids, skip_special_tokens=True), ids
    tok.clean_up_tokenization_spaces = True
    assert text_decoder(tok).func == tok.decode
