from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Mirrors nano-vllm / vLLM so callers can switch.

    temperature=0 is greedy; top_k=0 and top_p=1 switch those filters off. A seed makes the
    request's draws reproducible whatever else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop: list[str] | None = field(default=None)
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 means off), got {self.top_k!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
            self.stop = list(self.stop)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
