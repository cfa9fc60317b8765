import torch

from engine.core.sampling_params import SamplingParams

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


def _beyond_top_k(top_k: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] bool: True at the sorted ranks past each row's top_k."""
    rank = torch.arange(vocab, device=top_k.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    return rank[None, :] >= k[:, None]


def _filter_sorted(logits: torch.Tensor, beyond_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """filter_top_k_top_p given _beyond_top_k's mask and top_p as a [rows, 1] column."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.masked_fill(beyond_k, float("-inf")).softmax(-1)
    # Keep a token when the mass before it is still under top_p; the most likely token always stays.
    # top_p=1 must keep everything, but a float32 cumsum can round up to 1.0 before the tail's
    # tiny probabilities are added, so that row would lose them without the top_p < 1 guard.
    mass_before = probs.cumsum(-1) - probs
    drop = beyond_k | ((mass_before >= top_p) & (top_p < 1))
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    """Greedy, temperature, top-k and top-p sampling for a batch of rows with mixed settings.

    Sampling is argmax(p / E) with E ~ Exp(1), which draws from p. A seeded request draws E from a
    generator seeded by (seed, token position), so its tokens do not depend on what else shares
    the batch, nor on preemption and recompute.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.generator = torch.Generator(device=device)
        # The device tensors of the last batch's per-row settings, and the settings they hold.
        # Streams keep their settings from one step to the next, and building these tensors (on a
        # GPU a pinned buffer and a copy each) was most of the sampler's host time at chat sizes.
        self._rows_key = None
        self._rows = None

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        # Pinned and non-blocking: a plain copy to the GPU would wait for the forward pass to end
        # before the host could queue the rest of sampling.
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def _row_settings(self, params: list[SamplingParams], vocab: int):
        """(temperatures as a column, greedy rows or None, (top-k mask, top-p column) or None)."""
        key = (vocab, [(p.temperature, p.top_k, p.top_p) for p in params])
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
            top_k = self._to_device([min(p.top_k, vocab) for p in params], torch.int64)
            filters = (_beyond_top_k(top_k, vocab), self._to_device([p.top_p for p in params], torch.float32)[:, None])
        self._rows, self._rows_key = (temps, greedy_rows, filters), key
        return self._rows

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        """logits: [rows, vocab] in the model's dtype; positions: each row's token position, which
        keys seeded draws. Returns the int64 tokens on the logits' device, without waiting for them."""
        # Up-casting is exact and keeps order, so the argmax of bf16 logits is the argmax of their
        # float32 copy (first index on ties in both), without writing that copy.
        if all(p.temperature == 0 for p in params):
            return logits.argmax(-1)
        temps, greedy_rows, filters = self._row_settings(params, logits.shape[-1])
        seeded = [(row, (p.seed * _SEED_MIX + positions[row]) % (2**63))
                  for row, p in enumerate(params) if p.seed is not None and p.temperature > 0]
        rows = logits.shape[0]
        if rows <= SAMPLE_CHUNK_ROWS:
            return draw(logits, temps, greedy_rows, filters, seeded, self.generator)
        tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
        for start in range(0, rows, SAMPLE_CHUNK_ROWS):
            chunk = slice(start, start + SAMPLE_CHUNK_ROWS)
            tokens[chunk] = draw(logits[chunk], temps[chunk], None if greedy_rows is None else greedy_rows[chunk],
                                 None if filters is None else (filters[0][chunk], filters[1][chunk]),
                                 [(row - start, seed) for row, seed in seeded if chunk.start <= row < chunk.stop],
                                 self.generator)
        return tokens


def draw(logits: torch.Tensor, temps: torch.Tensor, greedy_rows: torch.Tensor | None, filters, seeded=(),
         generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row: argmax(p / E), E ~ Exp(1), over the row's softmax at its temperature
    (temps: a [rows, 1] column), within its top-k and top-p when filters (_beyond_top_k's mask, a
    top_p column) are given; greedy_rows (bool [rows], or None for none) take the argmax. No host
    sync, so a CUDA graph can capture it as it is. seeded: (row, seed) pairs whose E comes from
    generator seeded so, which a graph cannot replay."""
    greedy_tokens = logits.argmax(-1) if greedy_rows is not None else None
    # Dividing by float32 temperatures promotes to float32: the values .float() would give,
    # in one pass over the logits instead of two.
    logits = logits / temps
    if filters is not None:
        logits = _filter_sorted(logits, *filters)
    probs = logits.softmax(-1)
    noise = torch.empty_like(probs).exponential_()
    for row, seed in seeded:
        generator.manual_seed(seed)
        noise[row].exponential_(generator=generator)
    sampled = probs.div_(noise).argmax(-1)
    if greedy_tokens is None:
        return sampled
    return torch.where(greedy_rows, greedy_tokens, sampled)
