import torch

from engine import LLM, SamplingParams
from engine.runner.sampler import (
    SAMPLE_CHUNK_ROWS,
    TOP_K_WIDTH,
    Sampler,
    _beyond_top_k,
    _filter_sorted,
    filter_top_k_top_p,
    filter_width,
    top_p_alone,
)


def test_top_k_keeps_exactly_k_most_likely():
    logits = torch.randn(3, 50)
    out = filter_top_k_top_p(logits, torch.tensor([5, 1, 0]), torch.ones(3))
    kept = torch.isfinite(out)
    assert kept.sum(-1).tolist() == [5, 1, 50]
    for row, k in ((0, 5), (1, 1)):
        assert set(kept[row].nonzero().flatten().tolist()) == set(logits[row].topk(k).indices.tolist())
        assert torch.equal(out[row][kept[row]], logits[row][kept[row]])


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    logits = torch.randn(3, 40) * 3
    top_p = torch.tensor([0.1, 0.5, 0.9])
    out = filter_top_k_top_p(logits, torch.zeros(3, dtype=torch.long), top_p)
    for row in range(3):
        probs = logits[row].softmax(-1)
        order = probs.argsort(descending=True)
        kept = torch.isfinite(out[row])
        count = int(kept.sum())
        assert kept[order[:count]].all(), "the kept tokens are the most likely ones"
        mass = probs[order].cumsum(0)
        # The nucleus reaches top_p, and without its least likely token it would not. The slack
        # covers float32 summation order, which differs between this oracle and the filter.
        assert mass[count - 1] >= top_p[row] - 1e-5
        assert count == 1 or mass[count - 2] < top_p[row] + 1e-5


def test_top_p_of_one_keeps_even_tokens_whose_mass_rounds_away():
    # Past the first token the float32 cumsum is already 1.0, which once made top_p=1 drop the
    # tail whenever another row of the batch switched filtering on.
    logits = torch.cat([torch.zeros(2, 1), torch.full((2, 30), -30.0) - torch.rand(2, 30)], dim=1)
    out = filter_top_k_top_p(logits, torch.tensor([0, 3]), torch.tensor([1.0, 0.5]))
    assert torch.isfinite(out[0]).all()
    assert torch.isfinite(out[1]).sum() == 1


def test_the_narrow_filter_keeps_what_the_sort_of_the_whole_vocabulary_keeps():
    """Rows that keep at most TOP_K_WIDTH tokens by top_k are filtered over their largest logits
    only (a top-k instead of a sort): the same logits kept, the same -inf elsewhere, with top_p
    cutting inside the top-k, at the width's edge, and structured output's -inf in the row."""
    vocab = 3000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(11)) * 3
    logits[5, 40:] = float("-inf")  # fewer allowed tokens than the width
    top_k = torch.tensor([1, 20, 64, 64, 7, 64])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.3, 0.5, 0.99])
    params = [SamplingParams(temperature=0.7, top_k=int(k)) for k in top_k]
    assert filter_width(params, vocab) == TOP_K_WIDTH
    narrow = _filter_sorted(logits, _beyond_top_k(top_k, TOP_K_WIDTH), top_p[:, None])
    assert torch.equal(narrow, filter_top_k_top_p(logits, top_k, top_p))
    kept = torch.isfinite(narrow).sum(-1).tolist()
    assert kept[0] == 1 and kept[2] == 64 and 1 <= kept[1] < 20 and kept[5] <= 40


def test_the_filter_ranks_the_whole_vocabulary_unless_every_sampling_row_keeps_few():
    few = SamplingParams(temperature=0.7, top_k=TOP_K_WIDTH)
    greedy = SamplingParams(temperature=0)  # its top_k is 0 (off), and the argmax needs no filter
    assert filter_width([few, greedy], 1000) == TOP_K_WIDTH
    assert filter_width([few, SamplingParams(temperature=0.7, top_p=0.9)], 1000) == 1000
    assert filter_width([few, SamplingParams(temperature=0.7, top_k=TOP_K_WIDTH + 1)], 1000) == 1000
    assert filter_width([few], TOP_K_WIDTH) == TOP_K_WIDTH  # a vocabulary no wider: the sort as it was
    # A seeded row's draw must not depend on its batch, and with tied logits the two widths may keep
    # different tokens: a batch with one takes the sort.
    assert filter_width([few, SamplingParams(temperature=0.7, top_k=20, seed=1)], 1000) == 1000


def test_top_p_without_top_k_is_drawn_without_the_sort_only_where_no_row_needs_it():
    nucleus = SamplingParams(temperature=0.7, top_p=0.9)
    plain = SamplingParams(temperature=1.0)
    greedy = SamplingParams(temperature=0, top_k=5)  # the argmax: its top_k cuts nothing
    assert top_p_alone([nucleus, plain, greedy], 1000)
    assert top_p_alone([SamplingParams(temperature=0.7, top_p=0.9, top_k=1000)], 1000)  # keeps every token
    assert not top_p_alone([plain, greedy], 1000)  # nothing to cut: the plain draw
    assert not top_p_alone([nucleus, SamplingParams(temperature=0.7, top_k=40)], 1000)
    assert not top_p_alone([nucleus, SamplingParams(temperature=0.7, top_p=0.9, top_k=999)], 1000)
    assert not top_p_alone([nucleus, SamplingParams(temperature=0.7, top_p=0.9, seed=3)], 1000)
    # The eager sampler on a CPU sorts (the kernel runs on GPUs; the CPU interpreter would be slow).
    sampler = Sampler(torch.device("cpu"))
    assert sampler._row_settings([nucleus, plain], 1000)[2][0] is not None


def test_a_seeded_row_with_tied_logits_draws_the_same_alone_and_beside_a_row_without_top_k():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randint(0, 4, (2, 500)).float()  # hundreds of ties at every top-k cut
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=5)
    unfiltered = SamplingParams(temperature=1.0)  # alone, the seeded row could take the narrow filter
    for position in range(50):
        alone = sampler(logits[:1], [seeded], [position]).item()
        beside = sampler(logits, [seeded, unfiltered], [position, position]).tolist()[0]
        assert alone == beside, position


def test_batches_of_narrow_rows_sampled_in_chunks_keep_each_rows_settings():
    sampler = Sampler(torch.device("cpu"))
    rows = 2 * SAMPLE_CHUNK_ROWS + 3
    logits = torch.randn(rows, 200)
    params = [SamplingParams(temperature=1.0, top_k=1 + row % TOP_K_WIDTH) for row in range(rows)]
    assert filter_width(params, 200) == TOP_K_WIDTH
    tokens = sampler(logits, params, list(range(rows)))
    ranks = (logits > logits.gather(1, tokens[:, None])).sum(-1)  # how many logits beat the drawn one
    assert all(rank < p.top_k for rank, p in zip(ranks.tolist(), params))
    assert (tokens[::TOP_K_WIDTH] == logits[::TOP_K_WIDTH].argmax(-1)).all()  # the rows at top_k=1


def test_narrow_rows_draw_from_their_top_k_top_p_distribution():
    """The narrow filter's draw looks at each row's TOP_K_WIDTH largest logits only: 8,000 draws of
    two rows against filter_top_k_top_p's distribution (the bound is about 3x the total variation
    distance expected of 8,000 exact draws over 30 tokens), and never a token it drops."""
    sampler = Sampler(torch.device("cpu"))
    vocab, draws = 300, 8000
    base = torch.randn(2, vocab) * 2
    params = [SamplingParams(temperature=0.9, top_k=8), SamplingParams(temperature=1.2, top_k=30, top_p=0.7)]
    assert filter_width(params, vocab) == TOP_K_WIDTH
    tokens = sampler(base.repeat(draws, 1), params * draws, list(range(2 * draws))).view(draws, 2)
    seen = torch.zeros(2, vocab).scatter_add_(1, tokens.T, torch.ones(2, draws)) / draws
    temps = torch.tensor([[0.9], [1.2]])
    probs = filter_top_k_top_p(base / temps, torch.tensor([8, 30]), torch.tensor([1.0, 0.7])).softmax(-1)
    assert (0.5 * (seen - probs).abs().sum(-1) < 0.07).all()
    assert (seen[probs == 0] == 0).all()


def test_sampler_draws_from_the_distribution():
    sampler = Sampler(torch.device("cpu"))
    probs = torch.tensor([0.6, 0.3, 0.1, 0.0])
    logits = probs.log().expand(4000, 4).clone()
    params = [SamplingParams(temperature=1.0)] * 4000
    tokens = sampler(logits, params, list(range(4000)))
    freq = torch.bincount(tokens, minlength=4).float() / 4000
    assert torch.allclose(freq, probs, atol=0.05)  # 6.5 sigma at p=0.6
    assert freq[3] == 0


def test_seeded_draws_depend_only_on_seed_and_position():
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(3, 100)
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = sampler(logits[1:2], [seeded], [10]).tolist()
    batch = [SamplingParams(temperature=1.0), seeded, SamplingParams(temperature=0)]
    batched = sampler(logits, batch, [3, 10, 5]).tolist()
    assert batched[1] == alone[0]
    assert batched[2] == int(logits[2].argmax())


def test_batches_sampled_in_chunks_keep_each_rows_settings_and_seed():
    sampler = Sampler(torch.device("cpu"))
    rows = 3 * SAMPLE_CHUNK_ROWS + 5
    logits = torch.randn(rows, 50)
    seeded = SamplingParams(temperature=1.0, top_k=5, seed=7)
    params = [SamplingParams(temperature=0)] * rows
    params[-2] = seeded
    params[2 * SAMPLE_CHUNK_ROWS + 1] = SamplingParams(temperature=1.0, top_k=1)
    positions = list(range(rows))
    tokens = sampler(logits, params, positions).tolist()
    assert tokens[-2] == sampler(logits[-2:-1], [seeded], positions[-2:-1]).tolist()[0]
    greedy = logits.argmax(-1).tolist()
    assert tokens[:-2] + tokens[-1:] == greedy[:-2] + greedy[-1:]


def test_seeded_generation_is_reproducible_and_varies_with_the_seed(tiny_qwen3):
    prompt = list(range(10, 30))
    with LLM(tiny_qwen3, device="cpu") as llm:
        runs = [llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=s))[0]
                for s in (1, 1, 2)]
    assert runs[0]["token_ids"] == runs[1]["token_ids"]
    assert runs[0]["token_ids"] != runs[2]["token_ids"]


def test_a_top_k_past_int64_keeps_every_token_and_fails_no_batch():
    """Any int is a valid top_k; from the vocabulary's size up it means "keep all", and one request's
    2**64 must not fail the step that samples everyone else."""
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(3, 50)
    huge = SamplingParams(temperature=1.0, top_k=2**64, seed=3)
    off = SamplingParams(temperature=1.0, top_k=0, seed=3)
    tokens = sampler(logits, [SamplingParams(temperature=0), huge, SamplingParams(temperature=0)], [0, 1, 2]).tolist()
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert tokens[1] == sampler(logits[1:2], [off], [1]).tolist()[0]


def test_a_temperature_too_small_for_float32_is_greedy():
    """1e-50 is a valid temperature, 0 in float32: the logits divided by it would be inf and NaN
    and draw noise. Such a temperature takes the argmax, which it would draw anyway."""
    sampler = Sampler(torch.device("cpu"))
    logits = torch.randn(4, 300) * 5
    tiny = [SamplingParams(temperature=t, top_p=p) for t, p in ((1e-50, 1.0), (1e-30, 0.9), (1e-21, 0.5))]
    assert all(p.temperature == 0 for p in tiny)
    assert SamplingParams(temperature=1e-6).temperature == 1e-6  # small but usable: still sampled
    tokens = sampler(logits, tiny + [SamplingParams(temperature=1.0, top_p=0.9)], [0, 1, 2, 3])
    assert tokens[:3].tolist() == logits[:3].argmax(-1).tolist()
