"""Backend: what a chat backend offers its callers, declared.

nvchat's app, REPL, pipe mode and `nvchat serve` talk to a Backend: the in-process EngineThread, or
nvchat's RemoteBackend over an OpenAI-compatible server. What one can do differs (a server neither
tokenizes for its client nor shows its KV cache), so each says so in its `capabilities`, data that
callers read instead of probing for methods. tests/test_backend_protocol.py checks both against it.

Torch-free, like the RequestStream and SamplingParams it names.
"""
from dataclasses import dataclass, field
from typing import Protocol, Self

from engine.core.sampling_params import SamplingParams
from engine.request_stream import RequestStream
from engine.text.tool_calls import Tools


@dataclass(frozen=True)
class BackendCapabilities:
    model_name: str | None  # the model's name where the backend knows it (a server's id); else the caller names it
    context_length: int | None  # tokens a prompt and its reply may fill together; None where unknown
    tokenizes: bool  # tokenize(), tokenize_chat() and detokenize() work here: a caller can fit a prompt and submit its ids
    block_stats: bool  # stats() returns the KV cache's state (the KV panel's blocks, /stats)
    # The sampling values the model's checkpoint recommends ({SamplingParams field: value}), which a
    # chat app offers as its defaults; empty where the backend knows none.
    recommended_sampling: dict = field(default_factory=dict)
    # The backend serves one request at a time (a remote server with one slot): submissions wait for
    # each other, and a caller with several chats open should say so.
    one_request_at_a_time: bool = False


@dataclass
class EngineSnapshot:
    """The engine's state between two steps, as stats() publishes it."""

    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_hit_tokens: int
    prompt_tokens: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    kv_bytes_total: int
    kv_bytes_used: int
    block_states: bytes  # one byte per block, codes as in engine.core.block_manager
    block_holders: dict[int, list[int]]  # request id -> block ids it holds
    taken_at: float
    # The KV cache's lower tiers (engine/core/kv_tiers.py): prompt tokens whose K/V came back from
    # each (prefix_hit_tokens counts them too), and each one's use and size; zero where one is off.
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    host_bytes_used: int = 0
    host_bytes_total: int = 0
    disk_bytes_used: int = 0
    disk_bytes_total: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Backend(Protocol):
    """A chat backend: started once, then any number of threads submit requests and read their
    streams; shut down once. Bad input raises ValueError; a stopped backend, RuntimeError."""

    fatal_error: str | None  # set once the backend can serve no more requests, saying why

    @property
    def capabilities(self) -> BackendCapabilities:
        ...

    def start(self) -> Self:
        """Loads the model or reaches the server; returns the backend."""
        ...

    def shutdown(self) -> None:
        """Ends every open request (finish_reason "abort") and stops."""
        ...

    def __enter__(self) -> Self:
        ...

    def __exit__(self, *exc) -> None:
        ...

    def submit(self, prompt, sampling_params: SamplingParams | None = None, *, enable_thinking: bool | None = None,
               tools: Tools | None = None, tag=None) -> RequestStream:
        """Starts a request and returns its stream at once. prompt: chat messages (OpenAI's: {"role",
        "content"} dicts, an assistant's "tool_calls" and "tool" messages included), text, or token
        ids. tools: the functions the reply may call; the stream's text is then the reply's without
        its calls, which come as the stream's tool_calls (and Delta.tool_calls), and a reply that
        calls ends with finish_reason "tool_calls"."""
        ...

    def submit_n(self, prompt, sampling_params: SamplingParams | None = None, *, enable_thinking: bool | None = None,
                 tools: Tools | None = None, tag=None) -> list[RequestStream]:
        """sampling_params.n replies to one prompt, a stream each, in order (stream.sample_index),
        each from its own seed (SamplingParams.sample_seed). The in-process engine prefills the
        prompt once for all of them; a server gets one request per reply, sent at once."""
        ...

    def tokenize_chat(self, messages: list[dict], enable_thinking: bool | None = None,
                      tools: Tools | None = None) -> list[int]:
        """The chat messages as the prompt token ids submit() would make of them, not checked against
        the context; RuntimeError where capabilities.tokenizes is false."""
        ...

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text as the prompt token ids submit() would make of it (add_special_tokens: the
        tokenizer's BOS first, where it adds one), not checked against the context; RuntimeError
        where capabilities.tokenizes is false."""
        ...

    def detokenize(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens included; RuntimeError where capabilities.tokenizes is false."""
        ...

    def prefetch(self, prompt_token_ids: list[int]) -> None:
        """Starts bringing back to the device, in the background, the KV cache's blocks of a prompt
        that a request will soon start with (a chat reopened before its next message) from where the
        cache keeps them (host memory, disk). A hint: nothing where there are no such tiers or the
        cache is not visible (a server), and never an error."""
        ...

    def stats(self) -> EngineSnapshot | None:
        """The latest snapshot of the engine's state, without waiting on it; None where
        capabilities.block_stats is false."""
        ...
