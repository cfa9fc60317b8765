import json
import math
from dataclasses import dataclass, field

# OpenAI's bounds: presence/frequency penalties in [-2, 2], logit_bias values in [-100, 100], at
# most 20 top log-probabilities per token.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 20
_SEED_STEP = 0x9E3779B97F4A7C15  # spreads the seeds of a request's samples apart (see sample_seed)


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the text a request may generate, enforced token by token: exactly one of
    json_schema (a JSON Schema, as a dict or its JSON text), json_object (any JSON object), regex
    (the whole reply matches it) or grammar (a Lark grammar, llguidance's dialect, whose `start`
    rule is the reply). engine.text.structured_output compiles it for the model's tokenizer."""

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured output takes exactly one of json_schema, json_object, regex or grammar"
                             f", got {', '.join(given) or 'none'}")
        if isinstance(self.json_schema, str):
            try:
                schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("json_schema must be a JSON object")
        elif self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(f"json_schema must be a dict or its JSON text, got {type(self.json_schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _finite(name: str, value, low: float | None = None, high: float | None = None) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
    return value


# Temperatures under this are greedy: the draw at one is the argmax anyway (logits a float32 step
# apart end up e^(1e13) apart), and under ~1e-38 dividing the logits by it overflows float32.
GREEDY_BELOW = 1e-20


@dataclass
class SamplingParams:
    """How to pick tokens for one request. Mirrors nano-vllm / vLLM so callers can switch.

    temperature=0 is greedy, and so is any temperature under GREEDY_BELOW (1e-20), which would take
    the argmax anyway, and by the smallest of which dividing the logits overflows float32.
    top_k=0, top_p=1 and min_p=0 switch those filters off. A seed makes the request's draws
    reproducible whatever else is in the batch.

    Each step turns the model's logits into the distribution drawn from in this order (vLLM's):
    logit_bias is added; tokens that may not come now are removed (the end-of-sequence tokens
    before min_tokens, whatever structured_output forbids); the penalties apply (repetition_penalty
    divides a positive logit and multiplies a negative one, for every token in the prompt or the
    completion so far; frequency_penalty times a token's count in the completion and
    presence_penalty once for any token in it are subtracted); the result is divided by the
    temperature; then min_p, top_k and top_p cut the tail, and the token is drawn.

    logprobs=N reports, for each generated token, its log-probability and the N most likely tokens'
    (0: the chosen token's only) under the distribution before that cut: the logits after bias,
    removals and penalties, divided by the temperature (1 for greedy decoding), through log_softmax.
    For plain greedy decoding that is log_softmax of the model's own logits.

    n > 1 draws n completions of the prompt: it is prefilled once and every sample shares its KV
    blocks. With a seed, sample i draws from its own stream (sample_seed), sample 0 from the seed
    itself, so its reply is the one n=1 would give.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 64
    ignore_eos: bool = False
    stop: list[str] | None = field(default=None)
    seed: int | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    n: int = 1
    structured_output: StructuredOutput | None = None

    def __post_init__(self):
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be >= 0 and finite (0 means greedy), got {self.temperature}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not (_is_int(self.max_tokens) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens):
            raise ValueError(f"min_tokens must be an integer from 0 to max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 means off), got {self.top_k!r}")
        _finite("min_p", self.min_p, 0.0, 1.0)
        if _finite("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 means off), got {self.repetition_penalty}")
        _finite("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _finite("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must map token ids to numbers, got {type(self.logit_bias).__name__}")
            bias = {}
            for token, value in self.logit_bias.items():
                # JSON objects (the OpenAI API's logit_bias) have string keys: "50256" is token 50256.
                if isinstance(token, str) and token.strip().isdigit():
                    token = int(token)
                if not (_is_int(token) and token >= 0):
                    raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                bias[token] = float(_finite(f"logit_bias[{token}]", value, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS))
            self.logit_bias = bias or None
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS} (or None), got {self.logprobs!r}")
        if not (_is_int(self.n) and self.n >= 1):
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.structured_output is not None and not isinstance(self.structured_output, StructuredOutput):
            raise ValueError("structured_output must be a StructuredOutput, got "
                             f"{type(self.structured_output).__name__}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is not None:
            if not all(isinstance(s, str) and s for s in self.stop):
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
            self.stop = list(self.stop)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def plain(self) -> bool:
        """Only temperature, top-k, top-p and the seed shape the draw: a decode CUDA graph's plain
        sampling. Penalties, min_p, logit_bias, min_tokens and structured output take its adjusted
        kinds; logprobs and a seed on a sampled row sample eagerly (engine.runner)."""
        return (not self.has_penalties and self.min_p == 0.0 and self.logit_bias is None and self.logprobs is None
                and self.min_tokens == 0 and self.structured_output is None)

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` (0 <= index < n): the seed itself for the first."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index * _SEED_STEP) % 2**64
