"""EngineThread: the engine on a background thread, fed by any number of caller threads; a Backend
(engine/backend.py).

Callers submit() requests and get RequestStreams back at once; the thread owns the LLM, applies
submissions and aborts between steps, and steps whenever work is pending. It also publishes a
snapshot of the engine's state for the UI's KV panel, so reading it never waits on a step.
"""
import contextlib
import dataclasses
import threading
import time
from collections import deque

from jinja2 import TemplateError

from engine.backend import BackendCapabilities, EngineSnapshot
from engine.core.sampling_params import SamplingParams, StructuredOutput
from engine.llm import LLM
from engine.options import CHAT_PREFILL_CHUNK
from engine.request_stream import RequestStream
from engine.text.tool_calls import Tools

_RATE_WINDOW_S = 2.0
_SNAPSHOT_EVERY_S = 0.05


@contextlib.contextmanager
def _template_errors_as_value_errors():
    """A chat template may refuse a conversation (Gemma's raises on a system message, Llama 2's on
    roles out of turn): that is bad input, and callers catch ValueError for it."""
    try:
        yield
    except TemplateError as e:
        raise ValueError(f"the model's chat template refused these messages: {e}") from None


def _with_tool_grammar(params: SamplingParams, grammar: str | None) -> SamplingParams:
    """params with the grammar that holds the reply's tool calls to their schemas, if there is one."""
    if grammar is None:
        return params
    if params.structured_output is not None:
        raise ValueError("a reply cannot be held both to a structured output and to tool calls: with tool_choice "
                         "\"required\" or a function named (or a strict tool), send no other constraint")
    return dataclasses.replace(params, structured_output=StructuredOutput(grammar=grammar))


class EngineThread:
    def __init__(self, llm_or_model, *, progress=None, **options):
        """llm_or_model: an LLM to run (and leave running), or the model to build one from, with
        EngineOptions' fields as keywords (engine/options.py); max_prefill_chunk defaults to
        CHAT_PREFILL_CHUNK here. progress: as LLM's."""
        if isinstance(llm_or_model, LLM):
            if options or progress is not None:
                raise ValueError("pass either an LLM or the arguments to build one, not both")
            self.llm, self._owns_llm = llm_or_model, False
        else:
            options.setdefault("max_prefill_chunk", CHAT_PREFILL_CHUNK)
            self.llm, self._owns_llm = LLM(llm_or_model, progress=progress, **options), True
        self._cv = threading.Condition()
        self._inbox: deque = deque()
        self._live: dict[int, tuple] = {}  # request id -> (sequence, stream); engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._steps: deque[tuple[float, int, int]] = deque()  # (time, prefill tokens, decode tokens)
        self.fatal_error: str | None = None
        self._snapshot_at = 0.0
        self._snapshot = self._take_snapshot()

    # --- lifetime ------------------------------------------------------------------------------------

    def start(self) -> "EngineThread":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="nvchat-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        """Stops the thread; open requests end with "abort" and give their blocks back. Shuts the
        LLM down if this built it."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        for seq, stream in list(self._live.values()):
            self.llm.abort(seq)
            stream._finish("abort")
        self._live.clear()
        for cmd in self._inbox:
            if cmd[0] == "submit":
                for stream in cmd[2]:
                    stream._finish("abort")
        self._inbox.clear()
        if self._owns_llm:
            self.llm.shutdown()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.shutdown()

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(model_name=None, context_length=self.llm.config.max_model_len,
                                   tokenizes=self.llm.tokenizer is not None, block_stats=True,
                                   recommended_sampling=self.llm.recommended_sampling)

    def tokenize_chat(self, messages: list[dict], enable_thinking: bool | None = None,
                      tools: Tools | None = None) -> list[int]:
        """Chat messages as prompt token ids through the chat template, not checked against the
        context (submit() checks them). Runs on the caller's thread."""
        with _template_errors_as_value_errors():
            return self.llm.tokenize_chat(messages, enable_thinking, tools)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text as prompt token ids, not checked against the context. Runs on the caller's thread."""
        return self.llm.tokenize(text, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.llm.detokenize(token_ids)

    # --- caller side ---------------------------------------------------------------------------------

    def prefetch(self, prompt_token_ids: list[int]) -> None:
        """Queues LLM.prefetch for the engine thread: the blocks come back between its steps."""
        if self.llm.tiers is not None and not self.fatal_error and not self._stopping:
            with self._cv:
                self._inbox.append(("prefetch", list(prompt_token_ids)))
                self._cv.notify()

    def submit(self, prompt, sampling_params: SamplingParams | None = None, *, enable_thinking: bool | None = None,
               tools: Tools | None = None, tag=None) -> RequestStream:
        """Queues a request and returns its stream at once. prompt: text, token ids, or chat messages
        ({"role", "content"} dicts, rendered with the chat template). tools: rendered with chat
        messages (a token-id prompt holds them already), the reply's calls parsed into the stream's
        tool_calls, and with tool_choice "required" or a function named (or a strict tool) held to
        their schemas (engine.text.tool_calls). Bad input raises ValueError. One sample only:
        submit_n() takes n > 1."""
        if sampling_params is not None and sampling_params.n > 1:
            raise ValueError(f"submit() streams one sample; use submit_n() for n={sampling_params.n}")
        return self.submit_n(prompt, sampling_params, enable_thinking=enable_thinking, tools=tools, tag=tag)[0]

    def submit_n(self, prompt, sampling_params: SamplingParams | None = None, *, enable_thinking: bool | None = None,
                 tools: Tools | None = None, tag=None) -> list[RequestStream]:
        """submit() for sampling_params.n samples of one prompt, prefilled once: a stream per sample,
        in order (stream.sample_index), each ended or aborted on its own."""
        self._check_open()
        if tools is not None and not isinstance(tools, Tools):
            raise ValueError(f"tools must be engine.text.tool_calls.Tools, got {type(tools).__name__}")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            with _template_errors_as_value_errors():
                prompt = self.llm.encode_chat(prompt, enable_thinking, tools)
        fmt = None
        if tools is not None and tools.offered:
            fmt = self.llm.tool_call_format()
            sampling_params = _with_tool_grammar(sampling_params or SamplingParams(), fmt.grammar(tools))
        seq = self.llm.make_sequence(prompt, sampling_params, stream=True)
        streams = [RequestStream(s.seq_id, s.num_prompt_tokens, self._request_abort, tag, s.sample_index,
                                 fmt.parser(tools) if fmt is not None else None)
                   for s in (seq, *seq.forks)]
        self._post(("submit", [seq, *seq.forks], streams))
        return streams

    def _check_open(self) -> None:
        if self.fatal_error:
            raise RuntimeError(f"the engine has stopped: {self.fatal_error}")
        if self._stopping:
            raise RuntimeError("the engine thread has been shut down")

    def _request_abort(self, stream: RequestStream) -> None:
        with self._cv:
            if self._stopping or self.fatal_error:
                return  # shutdown or the failure has ended the stream already
            self._inbox.append(("abort", stream))
            self._cv.notify()

    def _post(self, command) -> None:
        # Checked under the lock: a submission racing shutdown() is refused, never left unanswered.
        with self._cv:
            self._check_open()
            self._inbox.append(command)
            self._cv.notify()

    def stats(self) -> EngineSnapshot:
        """The latest published snapshot, with throughput over the last couple of seconds. Never waits
        on the engine."""
        now = time.perf_counter()
        recent = [s for s in list(self._steps) if now - s[0] <= _RATE_WINDOW_S]
        return dataclasses.replace(self._snapshot,
                                   prefill_tokens_per_s=sum(s[1] for s in recent) / _RATE_WINDOW_S,
                                   decode_tokens_per_s=sum(s[2] for s in recent) / _RATE_WINDOW_S)

    # --- engine thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug outside llm.step(): no stream may wait forever on a dead thread
            with self._cv:
                self.fatal_error = f"engine thread crashed: {type(e).__name__}: {e}"
                pending = [stream for cmd in self._inbox if cmd[0] == "submit" for stream in cmd[2]]
                self._inbox.clear()
            for stream in pending + [stream for _, stream in self._live.values()]:
                stream._finish("error", self.fatal_error)
            self._live.clear()
            raise

    def _serve(self) -> None:
        llm = self.llm
        host_cache_growing = True
        while True:
            with self._cv:
                while not self._inbox and not llm.has_unfinished() and not self._stopping:
                    self._publish(force=True)
                    if host_cache_growing:
                        break
                    self._cv.wait()
                if self._stopping:
                    return
                commands = list(self._inbox)
                self._inbox.clear()
            if not commands and not llm.has_unfinished():
                # Idle: the host KV tier pins its next piece (outside the lock, so that a request
                # can arrive meanwhile; it waits at most one piece, ~0.1 s).
                host_cache_growing = llm.grow_host_cache()
                continue
            for command in commands:
                self._apply(command)
            if not llm.has_unfinished():
                continue
            try:
                outputs = llm.step()
            except Exception as e:  # the engine must outlive one bad step: end the streams, keep serving
                self._fail_all(e)
                continue
            now = time.perf_counter()
            self._steps.append((now, *llm.last_step_tokens))
            while self._steps and now - self._steps[0][0] > _RATE_WINDOW_S:
                self._steps.popleft()
            for out in outputs:
                entry = self._live.get(out.seq.seq_id)
                if entry is None:
                    continue
                stream = entry[1]
                # Each output, not only the first: a fork of an n-sample request has its first token
                # before it is admitted on its own and finds the prompt's blocks in the cache.
                stream.num_cached_tokens = out.seq.num_cached_tokens
                stream._push(out.new_text, out.new_token_ids, out.logprobs)
                if out.finished:
                    del self._live[out.seq.seq_id]
                    stream._finish(out.seq.finish_reason)
            self._publish()

    def _apply(self, command) -> None:
        if command[0] == "prefetch":
            with contextlib.suppress(ValueError):  # a prompt the engine would refuse: nothing to bring back
                self.llm.prefetch(command[1])
        elif command[0] == "submit":
            _, seqs, streams = command
            self.llm.enqueue(seqs[0])  # the others are its forks
            for seq, stream in zip(seqs, streams):
                self._live[seq.seq_id] = (seq, stream)
        else:
            stream = command[1]
            entry = self._live.pop(stream.request_id, None)
            if entry is not None:
                self.llm.abort(entry[0])
                entry[1]._push(self.llm.flush_text(entry[0]), [])
            stream._finish("abort")

    def _fail_all(self, error: Exception) -> None:
        message = f"{type(error).__name__}: {error}"
        # Marked stopped before any stream ends: a client woken by its stream's error must find the
        # engine refusing new requests, not queue one that nothing will run.
        if getattr(self.llm.runner, "broken", False):
            self.fatal_error = message
        for seq, stream in self._live.values():
            self.llm.scheduler.finish(seq, "error")
            stream._finish("error", message)
        self._live.clear()
        self._publish(force=True)

    def _publish(self, force: bool = False) -> None:
        now = time.perf_counter()
        if force or now - self._snapshot_at >= _SNAPSHOT_EVERY_S:
            self._snapshot = self._take_snapshot()
            self._snapshot_at = now

    def _take_snapshot(self) -> EngineSnapshot:
        llm = self.llm
        s = llm.stats()
        block_bytes = llm.config.kv_bytes_per_token * s.block_size * llm.config.tensor_parallel_size
        return EngineSnapshot(
            num_blocks=s.num_blocks, block_size=s.block_size, num_free_blocks=s.num_free_blocks,
            num_cached_blocks=s.num_cached_blocks, prefix_hit_tokens=s.prefix_hit_tokens,
            prompt_tokens=s.prompt_tokens, num_running=s.num_running, num_waiting=s.num_waiting,
            num_preemptions=s.num_preemptions, prefill_tokens_per_s=0.0, decode_tokens_per_s=0.0,
            kv_bytes_total=s.num_blocks * block_bytes, kv_bytes_used=s.num_used_blocks * block_bytes,
            block_states=bytes(llm.blocks.states),
            block_holders={seq.seq_id: list(seq.block_table) for seq in llm.scheduler.running},
            taken_at=time.perf_counter(), host_hit_tokens=s.host_hit_tokens, disk_hit_tokens=s.disk_hit_tokens,
            host_bytes_used=s.host_blocks * block_bytes, host_bytes_total=s.host_capacity_blocks * block_bytes,
            disk_bytes_used=s.disk_bytes, disk_bytes_total=s.disk_capacity_bytes)
