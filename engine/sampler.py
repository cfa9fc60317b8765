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

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> list[int]:
        logits = logits.float()
        greedy = logits.argmax(-1)
        if all(p.greedy for p in params):
            return greedy.tolist()
        dev = logits.device
        temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=dev)
        logits = logits / temps[:, None]
        if any(p.top_k > 0 or p.top_p < 1 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=dev)
            top_p = torch.tensor([p.top_p for p in params], device=dev)
            logits = filter_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        for row, (p, pos) in enumerate(zip(params, positions)):
            if p.seed is not None and not p.greedy:
                self.generator.manual_seed((p.seed * _SEED_MIX + pos) % (2**63))
                noise[row].exponential_(generator=self.generator)
        sampled = (probs / noise).argmax(-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=dev)
        return torch.where(is_greedy, greedy, sampled).tolist()
