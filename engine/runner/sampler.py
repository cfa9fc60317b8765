import math
from array import array

import torch

from engine.core.sampling_params import SamplingParams
from engine.core.step_plan import SampleContext

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the generator's seed space
# Rows sampled at a time. Sampling holds several float32 copies of each row's logits (and with
# top-k/top-p a sort with int64 indices): ~2.5 GiB for 512 rows of a 152K vocabulary, more than a
# small model's whole prefill needs. Chunks halve that at 512 rows. Smaller ones would cost a set
# of launches each in every big step (with 64-row chunks and 256 streams, bench_throughput lost
# 1.5-2% on the H200).
SAMPLE_CHUNK_ROWS = 256


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets logits outside each row's top-k and top-p nucleus to -inf. top_k=0 and top_p=1 keep all."""
    return _filter_sorted(logits, _beyond_top_k(top_k, logits.shape[-1]), top_p[:, None])


def _beyond_top_k(top_k: torch.Tensor, width: int) -> torch.Tensor:
    """[rows, width] bool: True at the sorted ranks past each row's top_k, over the first `width`
    ranks (the vocabulary, or filter_width's narrower one)."""
    rank = torch.arange(width, device=top_k.device)
    k = torch.where(top_k > 0, top_k, width).clamp(max=width)
    return rank[None, :] >= k[:, None]


# Every row that samples keeps at most this many tokens (0 < top_k <= TOP_K_WIDTH): the filter
# looks only at each row's TOP_K_WIDTH largest logits, a top-k instead of a sort of the whole
# vocabulary. The app's default top_k is 20 (nvchat.settings), as Qwen3 recommends; llama.cpp's 40.
TOP_K_WIDTH = 64


def filter_width(params, vocab: int) -> int:
    """The columns of _beyond_top_k's mask for these rows' filter: TOP_K_WIDTH when every row with
    a temperature keeps at most that many tokens by its top_k (greedy rows take the argmax, which
    every filter keeps), else the whole vocabulary. Both keep the same logit values, but where
    tied logits straddle the cut, topk and sort may keep different ones of them; so a batch with
    a seeded row, whose draw must not depend on what shares its batch, always takes the sort."""
    if vocab > TOP_K_WIDTH and all(p.temperature == 0 or (0 < p.top_k <= TOP_K_WIDTH and p.seed is None)
                                   for p in params):
        return TOP_K_WIDTH
    return vocab


def top_p_alone(params, vocab: int) -> bool:
    """Whether these rows' filter is top-p with no top-k, so that kernels.top_p_sampling can draw
    them without sorting the vocabulary: some row samples with top_p under 1, none samples with
    a top_k under the vocabulary's size, and none is seeded (as for filter_width, a seeded row's
    draw must not depend on what shares its batch, and float32 sums may see a token on the
    nucleus' edge otherwise than the sort's cumsum)."""
    sampling = [p for p in params if p.temperature > 0]
    return (any(p.top_p < 1 for p in sampling)
            and all((p.top_k == 0 or p.top_k >= vocab) and p.seed is None for p in sampling))


def _filter_sorted(logits: torch.Tensor, beyond_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """filter_top_k_top_p given _beyond_top_k's mask and top_p as a [rows, 1] column. A mask
    narrower than the logits (filter_width) ranks only that many of each row's largest logits;
    every token past them is dropped."""
    ranked, order = _ranked(logits, beyond_k.shape[-1])
    ranked = _cut_ranked(ranked, beyond_k, top_p)
    out = torch.empty_like(logits) if ranked.shape[-1] == logits.shape[-1] else torch.full_like(logits, float("-inf"))
    return out.scatter_(-1, order, ranked)


def _ranked(logits: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` largest logits, largest first, and their tokens: a top-k below the
    vocabulary's size, a sort at it."""
    if width < logits.shape[-1]:
        return logits.topk(width, dim=-1)
    return logits.sort(dim=-1, descending=True)


def _cut_ranked(ranked: torch.Tensor, beyond_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Ranked logits (largest first) with -inf at the ranks past top-k and outside the nucleus."""
    probs = ranked.masked_fill(beyond_k, float("-inf")).softmax(-1)
    # Keep a token when the mass before it is still under top_p; the most likely token always stays.
    # top_p=1 must keep everything, but a float32 cumsum can round up to 1.0 before the tail's
    # tiny probabilities are added, so that row would lose them without the top_p < 1 guard.
    mass_before = probs.cumsum(-1) - probs
    drop = beyond_k | ((mass_before >= top_p) & (top_p < 1))
    drop[:, 0] = False
    return ranked.masked_fill(drop, float("-inf"))


class Sampler:
    """Turns a batch of rows' logits into tokens, each row with its own settings.

    Sampling is argmax(p / E) with E ~ Exp(1), which draws from p. A seeded request draws E from a
    generator seeded by (seed, token position), so its tokens do not depend on what else shares
    the batch, nor on preemption and recompute.

    Rows whose SamplingParams are plain (temperature, top-k, top-p, seed) take the short path that
    a decode CUDA graph also captures (draw). Any other row (penalties, min_p, logit_bias,
    min_tokens, logprobs, structured output) sends its whole chunk of rows through adjust_logits
    first: SamplingParams' docstring gives the order of the adjustments. A decode graph's adjusted
    kinds (engine.runner.decode_graphs) do the same for the first four, with the same ops.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        # The device tensors of the last batch's per-row settings, and the settings they hold.
        # Streams keep their settings from one step to the next, and building these tensors (on a
        # GPU a pinned buffer and a copy each) was most of the sampler's host time at chat sizes.
        self._rows_key = None
        self._rows = None

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        # Pinned and non-blocking: a plain copy to the GPU would wait for the forward pass to end
        # before the host could queue the rest of sampling.
        if isinstance(values, torch.Tensor):
            host = values.pin_memory() if self.device.type == "cuda" else values
        else:
            host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def _row_settings(self, params: list[SamplingParams], vocab: int):
        """(temperatures as a column, greedy rows or None, (top-k mask, top-p column) or None)."""
        key = (vocab, [(p.temperature, p.top_k, p.top_p, p.seed is None) for p in params])
        if key == self._rows_key:
            return self._rows
        is_greedy = [p.temperature == 0 for p in params]
        temps = self._to_device([1.0 if greedy else p.temperature for p, greedy in zip(params, is_greedy)],
                                torch.float32)[:, None]
        greedy_rows = self._to_device(is_greedy, torch.bool) if any(is_greedy) else None
        filters = None
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            # Any top_k from the vocabulary's size up keeps every token; capped so that one request's
            # huge value (2**64 is a valid int) can't overflow the tensor and fail the whole batch.
            top_p = self._to_device([p.top_p for p in params], torch.float32)[:, None]
            if self.device.type == "cuda" and top_p_alone(params, vocab):
                filters = (None, top_p)
            else:
                top_k = self._to_device([min(p.top_k, vocab) for p in params], torch.int64)
                filters = (_beyond_top_k(top_k, filter_width(params, vocab)), top_p)
        self._rows, self._rows_key = (temps, greedy_rows, filters), key
        return self._rows

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        return self.sample(logits, params, positions)[0]

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
               contexts: list[SampleContext | None] | None = None, last_tokens: torch.Tensor | None = None,
               masks: tuple[list[int], torch.Tensor] | None = None):
        """logits: [rows, vocab] in the model's dtype; positions: each row's token position, which
        keys seeded draws. contexts: each row's SampleContext or None (StepPlan.sample_contexts);
        last_tokens: each row's input token on the device (the last token of its sequence, which
        the penalties count; needed when a context has history); masks: (rows, int32 bitmasks
        [len(rows), ceil(vocab / 32)] on the CPU, bit t of a row set when token t is allowed), for
        the rows under structured output. Returns (tokens, logprobs): the int64 tokens on the logits'
        device, without waiting for them, and None or Logprobs when some row asked for them."""
        # Up-casting is exact and keeps order, so the argmax of bf16 logits is the argmax of their
        # float32 copy (first index on ties in both), without writing that copy.
        plain = all(p.plain for p in params)
        all_greedy = all(p.temperature == 0 for p in params)
        if plain and all_greedy:
            return logits.argmax(-1), None
        temps, greedy_rows, filters = self._row_settings(params, logits.shape[-1])
        seeded = [(row, (p.seed * _SEED_MIX + positions[row]) % (2**63))
                  for row, p in enumerate(params) if p.seed is not None and p.temperature > 0]
        rows = logits.shape[0]
        want = max((p.logprobs for p in params if p.logprobs is not None), default=None)
        logprobs = Logprobs.empty(rows, want, logits.device) if want is not None else None
        tokens = torch.empty(rows, dtype=torch.int64, device=logits.device) if rows > SAMPLE_CHUNK_ROWS else None
        for start in range(0, rows, SAMPLE_CHUNK_ROWS):
            chunk = slice(start, start + SAMPLE_CHUNK_ROWS)
            whole = rows <= SAMPLE_CHUNK_ROWS
            c_temps = temps if whole else temps[chunk]
            c_greedy = None if greedy_rows is None else greedy_rows if whole else greedy_rows[chunk]
            c_filters = None if filters is None else filters if whole else (
                None if filters[0] is None else filters[0][chunk], filters[1][chunk])
            c_seeded = [(row - start, seed) for row, seed in seeded if chunk.start <= row < chunk.stop]
            c_logits = logits if whole else logits[chunk]
            if plain:
                out = draw(c_logits, c_temps, c_greedy, c_filters, c_seeded, self.generator)
            else:
                adjusted = self.adjust_logits(c_logits, params[chunk], (contexts or [None] * rows)[chunk],
                                              None if last_tokens is None else last_tokens[chunk],
                                              _masks_in(masks, chunk.start, min(chunk.stop, rows)))
                if all_greedy:
                    # min_p, top-k and top-p never drop the most likely token, so no row needs the
                    # softmax or the noise (on a CPU the noise for 64 rows of a 49K vocabulary took
                    # longer than the rest of the step).
                    if logprobs is not None:
                        logprobs.fill(chunk, adjusted)
                    out = adjusted.argmax(-1)
                else:
                    scaled = adjusted / c_temps
                    if logprobs is not None:
                        logprobs.fill(chunk, scaled)
                    scaled = self._min_p(scaled, params[chunk])
                    greedy_tokens = adjusted.argmax(-1) if c_greedy is not None else None
                    out = _draw_from(scaled, greedy_tokens, c_greedy, c_filters, c_seeded, self.generator)
            if whole:
                tokens = out
            else:
                tokens[chunk] = out
        if logprobs is not None:
            logprobs.chosen_of(tokens)
        return tokens, logprobs

    def adjust_logits(self, logits: torch.Tensor, params: list[SamplingParams], contexts: list,
                      last_tokens: torch.Tensor | None, masks: tuple[list[int], torch.Tensor] | None) -> torch.Tensor:
        """The logits, in float32, with logit_bias added, the tokens each row may not sample now set
        to -inf (structured output's mask, then min_tokens' bans unless they would leave nothing)
        and the penalties applied."""
        # A float32 copy to write into (the caller's logits stay as they are).
        logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
        rows, vocab = logits.shape
        bias = [(row, token, value) for row, p in enumerate(params) if p.logit_bias
                for token, value in p.logit_bias.items()]
        if bias:
            r, t, v = zip(*bias)
            logits.index_put_((self._to_device(r, torch.int64), self._to_device(t, torch.int64)),
                              self._to_device(v, torch.float32), accumulate=True)
        if masks is not None and masks[0]:
            mask_rows = self._to_device(masks[0], torch.int64)
            allowed = _unpack_bitmask(self._to_device(masks[1], torch.int32), vocab)
            logits[mask_rows] = logits[mask_rows].masked_fill(~allowed, float("-inf"))
        bans = [(row, token) for row, c in enumerate(contexts) if c is not None for token in c.banned if token < vocab]
        if bans:
            r, t = zip(*bans)
            banned = logits.index_put((self._to_device(r, torch.int64), self._to_device(t, torch.int64)),
                                      torch.tensor(float("-inf"), device=logits.device))
            # A row that the bans would leave with no token (structured output that allows only the
            # end of the reply, before min_tokens) keeps its end: a reply must end somewhere.
            logits = torch.where(torch.isfinite(banned).any(-1, keepdim=True), banned, logits)
        penalized = [row for row, p in enumerate(params) if p.has_penalties]
        if penalized:
            logits[penalized] = self._penalize(logits[penalized], [params[r] for r in penalized],
                                               [contexts[r] for r in penalized], last_tokens[penalized])
        return logits

    def _penalize(self, logits: torch.Tensor, params: list[SamplingParams], contexts: list[SampleContext],
                  last_tokens: torch.Tensor) -> torch.Tensor:
        """vLLM's and OpenAI's penalties over each row's tokens: its history (every token before the
        row's input) and its input token, which only the device knows while the step before is
        still sampling it."""
        rows, vocab = logits.shape
        histories = [c.history for c in contexts]
        width = max(map(len, histories)) + 1
        # One flat host buffer: each row's history, padded with `vocab` (a column dropped below).
        ids = array("q")
        for history in histories:
            ids += history
            ids += array("q", [vocab]) * (width - 1 - len(history))
        ids.append(0)  # frombuffer refuses an empty buffer: one spare entry, dropped by the view
        history = self._to_device(torch.frombuffer(ids, dtype=torch.int64)[:-1], torch.int64).view(rows, width - 1)
        ids = torch.cat([history, last_tokens[:, None]], dim=1)
        # Whether each position is in the completion: the last (input) token is when the history
        # reaches past the prompt.
        lengths = self._to_device(list(map(len, histories)), torch.int64)[:, None]
        prompt = self._to_device([c.num_prompt_tokens for c in contexts], torch.int64)[:, None]
        position = torch.arange(width, device=logits.device)[None, :].expand(rows, width)
        position = torch.where(position == width - 1, lengths, position)
        in_completion = (position >= prompt).float()
        counts = torch.zeros(rows, vocab + 1, device=logits.device).scatter_add_(1, ids, in_completion)[:, :vocab]
        seen = torch.zeros(rows, vocab + 1, device=logits.device).scatter_add_(
            1, ids, torch.ones_like(in_completion))[:, :vocab] > 0
        rep = self._to_device([p.repetition_penalty for p in params], torch.float32)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        freq = self._to_device([p.frequency_penalty for p in params], torch.float32)[:, None]
        presence = self._to_device([p.presence_penalty for p in params], torch.float32)[:, None]
        return logits - freq * counts - presence * (counts > 0).float()

    def _min_p(self, scaled: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Drops tokens less likely than min_p times the row's most likely one (on the scaled
        logits: p_t < min_p * p_max exactly when logit_t < logit_max + log(min_p))."""
        if not any(p.min_p > 0 for p in params):
            return scaled
        log_min_p = self._to_device([math.log(p.min_p) if p.min_p > 0 else float("-inf") for p in params],
                                    torch.float32)[:, None]
        return scaled.masked_fill(scaled < scaled.max(-1, keepdim=True).values + log_min_p, float("-inf"))


class Logprobs:
    """One step's log-probabilities on the device: the chosen token's [rows] and the `top` most
    likely tokens' ids and values [rows, top], for rows that asked (others hold whatever their
    logits gave; nobody reads them)."""

    def __init__(self, chosen: torch.Tensor, top_ids: torch.Tensor, top_values: torch.Tensor, all_rows):
        self.chosen, self.top_ids, self.top_values = chosen, top_ids, top_values
        self._log_probs = all_rows  # per chunk, until chosen_of()

    @classmethod
    def empty(cls, rows: int, top: int, device) -> "Logprobs":
        return cls(torch.zeros(rows, device=device), torch.zeros(rows, top, dtype=torch.int64, device=device),
                   torch.zeros(rows, top, device=device), [])

    def fill(self, chunk: slice, scaled: torch.Tensor) -> None:
        log_probs = scaled.log_softmax(-1)
        top = self.top_ids.shape[1]
        if top:
            values, ids = log_probs.topk(top, dim=-1)
            self.top_ids[chunk], self.top_values[chunk] = ids, values
        self._log_probs.append((chunk, log_probs))

    def chosen_of(self, tokens: torch.Tensor) -> None:
        for chunk, log_probs in self._log_probs:
            self.chosen[chunk] = log_probs.gather(1, tokens[chunk][:, None])[:, 0]
        self._log_probs = []


def _masks_in(masks, start: int, stop: int):
    """The part of (rows, bitmasks) for rows start..stop, renumbered from start."""
    if masks is None:
        return None
    picked = [(i, row - start) for i, row in enumerate(masks[0]) if start <= row < stop]
    if not picked:
        return None
    if len(picked) == len(masks[0]):
        return [row for _, row in picked], masks[1]
    return [row for _, row in picked], masks[1][[i for i, _ in picked]]


def _unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 words -> [rows, vocab] bool, bit t % 32 of word t // 32 for
    token t; tokens past the words' bits are not allowed."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int32)
    bits = ((words[:, :, None] >> shifts) & 1).bool().view(words.shape[0], -1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.cat([bits, bits.new_zeros(bits.shape[0], vocab - bits.shape[1])], dim=1)


def draw(logits: torch.Tensor, temps: torch.Tensor, greedy_rows: torch.Tensor | None, filters, seeded=(),
         generator: torch.Generator | None = None, noise=None) -> torch.Tensor:
    """One token per row: argmax(p / E), E ~ Exp(1), over the row's softmax at its temperature
    (temps: a [rows, 1] column), within its top-k and top-p when filters (_beyond_top_k's mask, a
    top_p column) are given, within its top-p by kernels.top_p_sampling when filters' mask is None
    (top_p_alone's rows); greedy_rows (bool [rows], or None for none) take the argmax. No host
    sync, so a CUDA graph can capture it as it is. seeded: (row, seed) pairs whose E comes from
    generator seeded so, which a graph cannot replay. noise: a function of a shape that returns E
    (float32) in place of torch's exponential_ (the decode graphs' kernels.exponential_noise)."""
    greedy_tokens = logits.argmax(-1) if greedy_rows is not None else None
    # Dividing by float32 temperatures promotes to float32: the values .float() would give,
    # in one pass over the logits instead of two.
    return _draw_from(logits / temps, greedy_tokens, greedy_rows, filters, seeded, generator, noise)


def _draw_from(scaled: torch.Tensor, greedy_tokens: torch.Tensor | None, greedy_rows: torch.Tensor | None, filters,
               seeded, generator, noise=None) -> torch.Tensor:
    """draw() from logits already divided by their temperatures, with the greedy rows' tokens."""
    if filters is not None and filters[0] is None:
        assert not seeded, "top_p_alone's rows are never seeded"
        from kernels.top_p_sampling import top_p_draw  # start-up: Triton loads only where it runs
        sampled = top_p_draw(scaled, _exponential_like(scaled, noise), filters[1][:, 0])
    else:
        sampled = _draw_filtered(scaled, filters, seeded, generator, noise)
    if greedy_tokens is None:
        return sampled
    return torch.where(greedy_rows, greedy_tokens, sampled)


def _exponential_like(x: torch.Tensor, noise) -> torch.Tensor:
    """Exp(1) samples shaped as x: noise(x.shape) where noise (a function of a shape) is given, else
    torch's exponential_ in x's dtype."""
    return torch.empty_like(x).exponential_() if noise is None else noise(x.shape)


def _draw_filtered(scaled: torch.Tensor, filters, seeded, generator, noise) -> torch.Tensor:
    """argmax(p / E) within _filter_sorted's cut (filters None: every token), E from torch's
    exponential_, the seeded rows' generator or noise."""
    if filters is not None and filters[0].shape[-1] < scaled.shape[-1]:
        # filter_width's narrow filter: every kept token is among the row's TOP_K_WIDTH largest, so
        # the draw looks at those only (its noise and softmax too), not at the whole vocabulary.
        assert not seeded, "filter_width gives seeded rows the whole vocabulary"
        ranked, order = _ranked(scaled, filters[0].shape[-1])
        probs = _cut_ranked(ranked, *filters).softmax(-1)
        return order.gather(-1, probs.div_(_exponential_like(probs, noise)).argmax(-1, keepdim=True))[:, 0]
    if filters is not None:
        scaled = _filter_sorted(scaled, *filters)
    probs = scaled.softmax(-1)
    noise = _exponential_like(probs, noise)
    for row, seed in seeded:
        generator.manual_seed(seed)
        noise[row].exponential_(generator=generator)
    return probs.div_(noise).argmax(-1)
