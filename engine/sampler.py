import torch

from engine.sampling_params import SamplingParams

_SEED_MIX = 0x9E3779B97F4A7C15  # spreads (seed, position) pairs over the generator's seed space


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sets logits outside each row's top-k and top-p nucleus to -inf. top_k=0 and top_p=1 keep all."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    drop = rank[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    # Keep a token when the mass before it is still under top_p; the most likely token always stays.
    mass_before = probs.cumsum(-1) - probs
    drop |= mass_before >= top_p[:, None]
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

    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        # Pinned and non-blocking: a plain copy to the GPU would wait for the forward pass to end
        # before the host could queue the rest of sampling.
        host = torch.tensor(values, dtype=dtype, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        """logits: [rows, vocab] in the model's dtype; positions: each row's token position, which
        keys seeded draws. Returns the int64 tokens on the logits' device, without waiting for them."""
        # Up-casting is exact and keeps order, so the argmax of bf16 logits is the argmax of their
        # float32 copy (first index on ties in both), without writing that copy.
        if all(p.temperature == 0 for p in params):
            return logits.argmax(-1)
        is_greedy = [p.temperature == 0 for p in params]
        temps = [1.0 if greedy else p.temperature for p, greedy in zip(params, is_greedy)]
        seeded = [(row, (p.seed * _SEED_MIX + positions[row]) % (2**63))
                  for row, p in enumerate(params) if p.seed is not None and p.temperature > 0]
        greedy_tokens = logits.argmax(-1) if any(is_greedy) else None
        # Dividing by float32 temperatures promotes to float32: the values .float() would give,
        # in one pass over the logits instead of two.
        logits = logits / self._to_device(temps, torch.float32)[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = self._to_device([p.top_k for p in params], torch.int64)
            top_p = self._to_device([p.top_p for p in params], torch.float32)
            logits = filter_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        for row, seed in seeded:
            self.generator.manual_seed(seed)
            noise[row].exponential_(generator=self.generator)
        sampled = probs.div_(noise).argmax(-1)
        if greedy_tokens is None:
            return sampled
        return torch.where(self._to_device(is_greedy, torch.bool), greedy_tokens, sampled)
