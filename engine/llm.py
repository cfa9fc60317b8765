"""The engine's front door: LLM holds the model runner, the scheduler and the tokenizer, and runs
requests step by step. generate() is the batch API; add_request()/step()/abort() are what the
streaming EngineThread drives.

A step is scheduled, planned and launched on the device, then its sampled tokens are settled on
the host: appended, committed to the prefix cache, detokenized and checked for a finish. With
async_scheduling (the default), step() launches the next step before it settles the
one in flight, so the GPU runs step N+1 while the host post-processes step N and then schedules and
builds step N+2: the GPU no longer waits through the host's work. Each sequence sampled by the
step in flight ends in a PENDING_TOKEN meanwhile; the next step's input for it is copied from that
step's sampled tokens on the device, in stream order (with tensor parallelism every rank holds
them: rank 0 broadcasts what it samples). A sequence that step N finishes has already
been given a row in step N+1: that row's token is dropped, and the blocks it wrote go back to the
free list, where any later user of them is queued behind step N+1 on the same stream. The row
writes the K/V of the sequence's last token, whose block is never a committed (cached) one: a
block is committed only once all its tokens are known, by the schedule of the step that computes
it (a prompt's blocks) or when its last token lands (a completion's).

A row under structured output needs its grammar's state after the token it runs on, which is still
being sampled when its step is launched. So a step with such rows is launched without its sampling
(the forward pass and the logits are queued). Once the step before has landed, its tokens go to
the grammars first, and the masks are computed and the sampling queued before the rest of that
step is settled, while the GPU runs the forward pass: constrained and unconstrained rows alike keep
the overlap, and the sampling waits only for the masks, not for the whole settle.

With host_cache_gib or disk_cache_dir, the KV cache has lower tiers (engine/core/kv_tiers.py):
each step's copies between them are queued ahead of the step (runner.transfer), and once the engine
is idle its cached blocks are written to disk in the background.
"""
import atexit
import dataclasses
import gc
import threading
from dataclasses import dataclass

import torch

from engine.checkpoints.generation_defaults import recommended_sampling
from engine.config import EngineConfig
from engine.core.block_manager import BlockManager
from engine.core.kv_tiers import DiskTier, KVTiers
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.sequence import PENDING_TOKEN, Sequence, TokenLogprobs
from engine.core.step_plan import plan_step
from engine.options import EngineOptions
from engine.runner.model_runner import ModelRunner, SampledTokens
from engine.runner.tp_runner import TensorParallelRunner
from engine.text.detokenizer import IncrementalDetokenizer, byte_run_ids, text_decoder
from engine.text.tokenizer import eos_token_ids, load_tokenizer
from engine.text.tokenizer_build import start_gguf_tokenizer_build, stop_gguf_tokenizer_build
from engine.text.tool_calls import ToolCallFormat, Tools, tool_call_format


# With nothing to run but a prompt whose blocks are being read from disk, step() waits this long
# at most for a read to end before it returns.
_IO_WAIT_S = 0.05


@atexit.register
def _unfreeze_at_exit():
    """Hands the objects LLM froze back to the collector, so the interpreter's last collection
    frees them: frozen Triton IR objects would otherwise be reported leaked by nanobind at exit."""
    gc.unfreeze()


@dataclass
class EngineStats:
    num_blocks: int
    block_size: int
    num_free_blocks: int  # free-list length, cached blocks included
    num_cached_blocks: int  # free blocks whose hash can still be reused
    prefix_hit_tokens: int
    prompt_tokens: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    # The lower tiers (engine/core/kv_tiers.py): prompt tokens whose K/V came back from each (all
    # counted in prefix_hit_tokens too), and their use; zeros where a tier is off.
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    host_blocks: int = 0
    host_capacity_blocks: int = 0
    disk_bytes: int = 0
    disk_capacity_bytes: int = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks


@dataclass(slots=True)  # one per sequence per step: slots make them cheaper to build
class StepOutput:
    """What one step did to one sequence that produced a token."""

    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    finished: bool
    # With SamplingParams.logprobs: one TokenLogprobs per new token.
    logprobs: list[TokenLogprobs] | None = None


@dataclass(slots=True)
class _Launched:
    """A step queued on the device whose tokens are not yet settled."""

    # Per sequence run: (sequence, its computed tokens once the step has run, its preemption count
    # at launch, the sequences whose next token the step samples: none, itself, or with a prompt's
    # forks those too, each a row of tokens in turn). A sampled token goes at index = count.
    entries: list[tuple[Sequence, int, int, list[Sequence]]]
    rows: dict[Sequence, int]  # sampled sequences -> their row in tokens
    tokens: SampledTokens | None  # None until a deferred step is sampled (LLM._sample_deferred)
    # Rows under structured output: (row, the sequence sampled there, the sequence run: itself,
    # or a prompt's first sample when the row's sequence is one of its forks).
    constrained: list[tuple[int, Sequence, Sequence]]


def _gpu_asked(device: str | None) -> bool:
    """Whether the engine will run on a GPU: asked for, or the default where one is visible."""
    return str(device).startswith("cuda") if device else torch.cuda.is_available()


class LLM:
    def __init__(self, model, *, progress=None, **options):
        """model: a checkpoint directory, a GGUF file or a Hub repo id. options: EngineOptions'
        fields (engine/options.py) as keywords; an unknown one is a TypeError naming the valid ones.
        progress: optional callable taking one string, told each start-up stage (for a UI).
        async_scheduling can be turned off between steps by setting the attribute."""
        self.options = EngineOptions.from_keywords("LLM", options)  # as given; self.config holds them resolved
        self._progress = progress or (lambda message: None)
        self._progress("reading the model config")
        # A GGUF file's first start on a GPU builds its tokenizer in another process while the model
        # loads and warms up (the CLI may have started it already); on a CPU the model's loading
        # keeps the cores busy, and the tokenizer is built here.
        if _gpu_asked(self.options.device):
            tokenizer_build = start_gguf_tokenizer_build(model)
        else:
            tokenizer_build = None
            stop_gguf_tokenizer_build(model)
        self.config = EngineConfig.create(model, self.options, progress=self._progress)
        # Caller threads encode prompts and render chat templates while the engine thread decodes
        # replies, on one tokenizer and without a lock: the Rust tokenizer's encode and decode only
        # read it (transformers changes its truncation and padding settings only for a call that
        # asks for others, which none here does; 1.4 million decodes beside long encodes raised
        # nothing). Under a shared lock, tokenizing a 3.2 MB prompt (14 s on a loaded 2-core box)
        # stopped every stream's text for as long.
        if tokenizer_build is None:
            self._progress("loading the tokenizer")
            self.tokenizer = load_tokenizer(self.config.model_path)
        # What the checkpoint recommends for sampling ({SamplingParams field: value}); not applied
        # here: front ends offer it as their defaults.
        self.recommended_sampling = recommended_sampling(self.config.model_path)
        self._grammars = None  # GrammarCompiler, made by the first request with structured output
        self._grammars_lock = threading.Lock()  # caller threads that compile at once make one
        self.runner = self._make_runner()
        if tokenizer_build is not None:
            if tokenizer_build.poll() is None:
                self._progress("waiting for the tokenizer's build")
                tokenizer_build.wait()
            self._progress("loading the tokenizer")
            try:
                self.tokenizer = load_tokenizer(self.config.model_path)
            except BaseException:
                self.runner.shutdown()
                raise
        self._decode_text = text_decoder(self.tokenizer) if self.tokenizer is not None else None
        self._byte_run_ids = byte_run_ids(self.tokenizer) if self.tokenizer is not None else frozenset()
        self.eos_ids = eos_token_ids(self.config.model_path, self.tokenizer, self.config.hf_config)
        self._eos_tuple = tuple(sorted(self.eos_ids))
        self.block_size = self.config.kvcache_block_size
        self.blocks = BlockManager(self.runner.num_blocks, self.block_size)
        self.tiers = self._make_tiers()
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.max_prefill_chunk, self.tiers)
        self.async_scheduling = self.config.async_scheduling
        self._inflight: _Launched | None = None
        self._closed = False
        self.last_step_tokens = (0, 0)  # (prefill, decode) tokens run by the last step launched
        # The model, tokenizer and libraries leave ~10^6 long-lived objects that every full garbage
        # collection would walk: one such pass stalled a chat's streams for 222 ms on the H200 box
        # (bench_streaming). They live as long as the engine, so take them out of the collector's
        # reach (until exit: see _unfreeze_at_exit).
        gc.collect()
        gc.freeze()

    def _make_runner(self):
        if self.config.tensor_parallel_size > 1:
            return TensorParallelRunner(self.config, progress=self._progress)
        return ModelRunner(self.config, progress=self._progress)

    def _make_tiers(self) -> KVTiers | None:
        c = self.config
        host_slots = self.runner.host_slots
        if not host_slots:
            return None
        disk = None
        if c.disk_cache_dir is not None:
            self._progress("listing the disk's KV blocks")
            file_bytes = c.kv_bytes_per_token * self.block_size * c.tensor_parallel_size
            disk = DiskTier(int(c.disk_cache_gib * 2**30), file_bytes, self.runner.disk_files())
        # On a GPU the blocks the free list hands out next are saved a step early, on a copy stream,
        # so that the step reusing one rarely waits for its copy: 128 blocks cover 8 steps of 256
        # decoding streams. On CPU a copy is made where it is needed.
        return KVTiers(self.blocks, host_slots, disk, spill_ahead=128 if c.device.type == "cuda" else 0,
                       usable_host_slots=self.runner.host_slots_allocated())

    # --- requests ------------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """A prompt as token ids, checked against the model and cache limits (ValueError if not)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenize(prompt)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) for t in ids):
                raise ValueError("a prompt must be a string or a list of integer token ids")
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt is {len(ids)} tokens, too long for max_model_len={limit} "
                             "(it must leave room for at least one generated token)")
        blocks = -(-(len(ids) + 1) // self.block_size)
        if blocks > self.blocks.num_blocks:
            raise ValueError(f"prompt needs {blocks} KV-cache blocks but the cache holds only "
                             f"{self.blocks.num_blocks}; raise num_kvcache_blocks or gpu_memory_utilization")
        return ids

    def render_chat(self, messages: list[dict], enable_thinking: bool | None = None, tools: Tools | None = None) -> str:
        """Chat messages as prompt text through the tokenizer's chat template. Messages are
        OpenAI-shaped, an assistant's tool_calls and tool messages included; tools, where offered,
        are rendered as the model's format has it (engine.text.tool_calls)."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model at {self.config.model_path} has no chat template")
        if not messages or not all(isinstance(m, dict) and "role" in m and ("content" in m or m.get("tool_calls"))
                                   for m in messages):
            raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        messages, tools_arg = self.tool_call_format().template_messages(messages, tools)
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        if tools_arg is not None:
            extra["tools"] = tools_arg
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)

    def tool_call_format(self) -> ToolCallFormat:
        """The format the model's chat template gives tool calls (engine.text.tool_calls)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: transformers renders tools with "tool_use"
            template = template.get("tool_use") or template.get("default")
        return tool_call_format(template)

    def tokenize_chat(self, messages: list[dict], enable_thinking: bool | None = None,
                      tools: Tools | None = None) -> list[int]:
        """Chat messages as prompt token ids, not yet checked against the model and cache limits
        (encode() checks them): for fitting a conversation to max_model_len."""
        # The template writes the special tokens it wants (a Llama-2 or Mistral one starts with
        # <s>): the tokenizer's own BOS on top would make two, so none is added, as HF's
        # apply_chat_template(tokenize=True) does.
        return self.tokenize(self.render_chat(messages, enable_thinking, tools), add_special_tokens=False)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text as token ids (the tokenizer's BOS first where it adds one), not checked against the
        model and cache limits."""
        if self.tokenizer is None:
            raise ValueError(f"model at {self.config.model_path} has no tokenizer: pass token ids, not text")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        """Token ids as text, special tokens included."""
        if self.tokenizer is None:
            raise ValueError(f"model at {self.config.model_path} has no tokenizer")
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise ValueError(f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def encode_chat(self, messages: list[dict], enable_thinking: bool | None = None,
                    tools: Tools | None = None) -> list[int]:
        """Chat messages as prompt token ids, checked as encode() checks them."""
        return self.encode(self.tokenize_chat(messages, enable_thinking, tools))

    def make_sequence(self, prompt, params: SamplingParams | None = None, *, stream: bool = False) -> Sequence:
        """A checked, tokenized request, not yet queued; safe to call from any thread. With
        stream=True the sequence is detokenized step by step and step() reports its new text.
        With params.n > 1 it is the first of n samples and holds the others in its forks (each
        reported as a sequence of its own: [seq, *seq.forks]). Structured output is compiled here,
        on the caller's thread (the first time, after building the grammar library's view of the
        tokenizer: see engine.text.structured_output)."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        ids = self.encode(prompt)
        self._check_params(params)
        matchers = [None] * params.n
        if params.structured_output is not None:
            matchers = self.grammars().matchers(params.structured_output, params.n)
        samples = []
        for index, matcher in enumerate(matchers):
            # Every sample but the first draws from its own seed (SamplingParams.sample_seed).
            sample_params = params if index == 0 else dataclasses.replace(params, seed=params.sample_seed(index))
            seq = Sequence(ids, sample_params, self.block_size, self.config.max_model_len)
            seq.sample_index, seq.matcher = index, matcher
            if (stream or params.stop) and self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, self._decode_text,
                                                         self._byte_run_ids, params.min_tokens)
            samples.append(seq)
        samples[0].forks = samples[1:]
        return samples[0]

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: its values against this model and engine."""
        vocab = self.config.hf_config.vocab_size
        if params.logit_bias:
            bad = [t for t in params.logit_bias if t >= vocab]
            if bad:
                raise ValueError(f"logit_bias has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} samples cannot run at once with max_num_seqs={self.config.max_num_seqs}")
        if params.structured_output is not None and self.tokenizer is None:
            raise ValueError(f"model at {self.config.model_path} has no tokenizer: structured output needs one")

    def grammars(self):
        """The structured-output compiler for this model's tokenizer (engine.text.structured_output).
        grammars().prepare() builds its tokenizer view ahead of the first constrained request."""
        if self.tokenizer is None:
            raise ValueError(f"model at {self.config.model_path} has no tokenizer: structured output needs one")
        with self._grammars_lock:
            if self._grammars is None:
                from engine.text.structured_output import (
                    GrammarCompiler,  # start-up: llguidance loads only for the first constrained request
                )
                self._grammars = GrammarCompiler(self.tokenizer, self.config.hf_config.vocab_size, self.eos_ids)
        return self._grammars

    def enqueue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def add_request(self, prompt, params: SamplingParams | None = None, *, stream: bool = False) -> Sequence:
        seq = self.make_sequence(prompt, params, stream=stream)
        self.enqueue(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        """Requests are under way, or a prefetch's reads and copies (step() carries them on)."""
        return self.scheduler.has_work() or (self.tiers is not None and self.tiers.prefetching)

    def prefetch(self, prompt) -> int:
        """Starts bringing the K/V of the prompt's leading blocks back to the device from the host
        and disk tiers, in the background (step() and generate() carry it on): for a conversation
        reopened before its next message, whose prompt then finds them cached and prefills only
        itself. Returns the blocks started: 0 without lower tiers, or when the device holds them
        all. A prompt add_request would refuse raises the same ValueError."""
        seq = self.make_sequence(prompt)
        if self.tiers is None:
            return 0
        return self.tiers.prefetch(seq)

    # --- stepping --------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Runs one step. With async_scheduling it returns the outputs of the step before, which
        the GPU ran while this one was being scheduled; the first step returns none."""
        tiers = self.tiers
        transfers_queued = tiers is None
        try:
            # Just after the overlap is turned off, a step is still in flight: this step is scheduled
            # over it as an overlapped one is, and then waited for. (Settling it first would leave
            # its tokens unreported whenever this step's launch then failed.)
            outputs = []
            if tiers is not None:
                self._update_tiers()
            batch, cut_short = self.scheduler.schedule()
            if not batch and not cut_short and tiers is not None and tiers.awaiting:
                # Only prompts waiting for their copies from a lower tier: run them, and the device waits.
                batch, cut_short = self.scheduler.schedule(hold_loads=False)
            self.last_step_tokens = (0, 0)
            if tiers is not None:
                self._send_transfers()
                transfers_queued = True
            launched = self._launch(batch) if batch else None
            previous, self._inflight = self._inflight, launched
            if previous is not None:
                deferred = launched if launched is not None and launched.tokens is None else None
                outputs += self._settle(previous, deferred)
            if launched is not None and launched.tokens is None:
                self._sample_deferred(launched)
            if not self.async_scheduling and self._inflight is not None:
                outputs += self._settle(self._take_inflight())
            for seq in cut_short:
                if not seq.is_finished:  # the token it had in flight may have ended it already
                    self.scheduler.finish(seq, "length")
                    outputs.append(StepOutput(seq, [], self.flush_text(seq), True))
            if tiers is not None and self._inflight is None:
                if not self.scheduler.has_work():
                    # More host slots first, for the disk writes that go through them; not during a
                    # prefetch, whose loads would wait the ~0.1 s that pinning a piece takes.
                    if not tiers.prefetching:
                        self.grow_host_cache()
                    self._persist()
                    if tiers.prefetching:  # its reads are under way (the steps queue its copies)
                        self.runner.wait_tier_io(_IO_WAIT_S)
                elif launched is None and tiers.fetching:
                    self.runner.wait_tier_io(_IO_WAIT_S)  # nothing to run until a read ends, or a write frees its slot
            return outputs
        except BaseException:
            self._fail_inflight()
            if not transfers_queued:
                tiers.forget_unqueued()
            self._forget_unlaunched()
            raise

    def _update_tiers(self) -> None:
        """Hands the tiers what the runner has finished: disk reads and writes, and loads."""
        tiers = self.tiers
        if tiers.io_pending:
            tiers.io_done(self.runner.poll_tier_io())
        if tiers.awaiting:
            tiers.loads_ready = self.runner.loads_done()

    def _send_transfers(self) -> None:
        """Queues the tiers' copies for this step, and the step's waits for them."""
        kv = self.tiers.take_transfers()
        if kv is not None:
            self.runner.transfer(kv)
        self.tiers.queued()

    def _persist(self) -> None:
        """Idle: the cached blocks the disk lacks are written to it in the background."""
        if self.tiers.disk is None:
            return
        try:
            self.tiers.persist()
            self._send_transfers()
        except BaseException:
            self.tiers.forget_unqueued()
            raise

    def grow_host_cache(self) -> bool:
        """Gives the host tier one more piece of its memory (256 MiB) if it is still short of
        host_cache_gib; returns whether more pieces are to come. Pinned memory stalls the GPU's work
        while it is allocated (engine/runner/kv_tiers.py: HostPool), so this runs only while nothing
        is in flight: when a step leaves the engine idle, and in EngineThread's idle moments."""
        tiers = self.tiers
        if tiers is None or self._inflight is not None or tiers.host.usable_slots >= tiers.host.num_slots:
            return False
        slots, more = self.runner.grow_host_pool()
        tiers.host.grow(slots)
        return more

    def flush_disk_cache(self) -> None:
        """Writes the cached blocks the disk lacks and waits until every write has ended (shutdown
        does this); nothing without a disk directory."""
        if self.tiers is None or self.tiers.disk is None:
            return
        self._update_tiers()
        self._persist()
        self.runner.drain_tier_io()
        self._update_tiers()  # the last writes may ask for older files to go, to keep to the cap
        self._persist()
        self.runner.drain_tier_io()

    def _take_inflight(self) -> _Launched:
        launched, self._inflight = self._inflight, None
        return launched

    def _launch(self, batch: list[tuple[Sequence, int]]) -> _Launched:
        """Plans and queues a step, then moves its sequences on as though it had run: each sampled
        sequence gets a pending token, so the next step can be scheduled before this one ends."""
        previous = self._inflight
        plan = plan_step(batch, self.block_size, previous.rows if previous is not None else None, self._eos_tuple)
        tokens = self.runner.execute(plan)
        self.blocks.launched()
        # Runs for every sequence of every step, on the host while the GPU works: keep it lean.
        entries, rows, constrained = [], {}, []
        decode = num_rows = 0
        for seq, n in batch:
            if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                decode += 1
            seq.num_computed_tokens += n
            count = seq.num_computed_tokens
            # A prompt chunk that does not reach the end samples nothing; a prompt's last chunk
            # samples its forks too.
            sampled = seq.samples_at(count)
            if sampled:
                rows[seq] = num_rows
                if plan.defer_sampling:
                    constrained += [(num_rows + i, s, seq) for i, s in enumerate(sampled) if s.matcher is not None]
                num_rows += len(sampled)
                seq.token_ids.append(PENDING_TOKEN)
            entries.append((seq, count, seq.num_preemptions, sampled))
        self.last_step_tokens = (len(plan.input_ids) - decode, decode)
        return _Launched(entries, rows, tokens, constrained)

    def _sample_deferred(self, launched: _Launched, grammars_ended: set[Sequence] = frozenset()) -> None:
        """Samples a launched step that has rows under structured output, with their masks: each
        computed from its grammar's state once the step before has landed, so that state includes
        the token this step's row runs on. The GPU meanwhile runs the step's forward pass. A
        sequence that has ended, or whose grammar the step before ended, gets an open mask: its
        token is dropped."""
        matchers = [None if seq.is_finished or seq in grammars_ended else seq.matcher
                    for _, seq, _ in launched.constrained]
        grammars = self.grammars()
        # Written where the runner copies them to the device from, when it has such a place.
        masks = grammars.masks(matchers, self.runner.mask_rows(len(matchers), grammars.words))
        launched.tokens = self.runner.sample_deferred(([row for row, _, _ in launched.constrained], masks))

    @staticmethod
    def _consume_grammar_tokens(launched: _Launched, tokens: list[int]) -> dict[Sequence, bool]:
        """Gives each grammar of a landed step its sampled token, as _settle_rows accepts them (a
        sequence it skips is skipped here too); returns, per constrained sequence, whether the token
        ended its grammar: one outside the mask (only ever the end of the reply, let through by
        min_tokens' fallback) or one that completes it."""
        ended = {}
        for row, sample, run in launched.constrained:
            matcher = sample.matcher
            if matcher is not None and not run.is_finished and not sample.is_finished:
                ended[sample] = not matcher.consume_token(tokens[row]) or matcher.is_stopped()
        return ended

    def _settle(self, launched: _Launched, deferred: _Launched | None = None) -> list[StepOutput]:
        """Waits for a launched step's tokens and post-processes its sequences. deferred: the step
        launched after it, waiting for its masks: it is sampled as soon as the grammars have their
        tokens, before the rest of the settle."""
        tokens = launched.tokens.tolist()
        grammars_ended = self._consume_grammar_tokens(launched, tokens) if launched.constrained else {}
        if deferred is not None:
            self._sample_deferred(deferred, {seq for seq, ended in grammars_ended.items() if ended})
        return self._settle_rows(launched, tokens, grammars_ended)

    def _settle_rows(self, launched: _Launched, tokens: list[int], grammars_ended: dict) -> list[StepOutput]:
        logprobs = launched.tokens.logprobs()
        commit = self.blocks.commit_full_blocks
        outputs = []
        row = 0
        for seq, count, preemptions, sampled in launched.entries:
            first, row = row, row + len(sampled)
            if seq.is_finished:
                continue  # aborted, or ended by its token of the step before: this one is dropped
            if seq.num_preemptions == preemptions:  # else its blocks went back and it recomputes
                commit(seq, count)
            if not sampled:
                continue
            if len(sampled) > 1:  # forks first: seq's own token may end it, and end them with it
                started = []
                for i, fork in enumerate(sampled[1:], first + 1):
                    if not fork.is_finished:
                        fork.num_cached_tokens = seq.num_cached_tokens
                        outputs.append(self._accept(fork, count, tokens[i], logprobs, i, grammars_ended))
                        if not fork.is_finished:
                            started.append(fork)
                self.scheduler.start_forks(seq, started)
            outputs.append(self._accept(seq, count, tokens[first], logprobs, first, grammars_ended))
        return outputs

    def _accept(self, seq: Sequence, count: int, token: int, logprobs, row: int,
                grammars_ended: dict[Sequence, bool]) -> StepOutput:
        """Gives seq the token sampled after its first `count` tokens (its pending token, or a
        fork's first), and ends it if that token does (or ends its grammar: grammars_ended, from
        _consume_grammar_tokens)."""
        if count < len(seq.token_ids):
            seq.token_ids[count] = token
        else:
            seq.token_ids.append(token)
        new_logprobs = None
        if seq.logprobs is not None:
            top = list(zip(logprobs[1][row][:seq.params.logprobs], logprobs[2][row][:seq.params.logprobs]))
            new_logprobs = [TokenLogprobs(token, logprobs[0][row], top)]
            seq.logprobs += new_logprobs
        grammar_done = grammars_ended.get(seq, False)
        text = seq.detokenizer.push([token]) if seq.detokenizer else ""
        reason = self._finish_reason(seq, token, count + 1) or ("stop" if grammar_done else None)
        if reason:
            self.scheduler.finish(seq, reason)
            text += self.flush_text(seq)
        return StepOutput(seq, [token], text, reason is not None, new_logprobs)

    def _fail_inflight(self) -> None:
        """After a failed step: a token still pending can no longer be trusted to arrive, so its
        sequence ends with "error" rather than ever running a token nobody samples."""
        self._inflight = None
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.token_ids[-1] == PENDING_TOKEN:
                self.scheduler.finish(seq, "error")

    def _forget_unlaunched(self) -> None:
        """After a step that failed before it was queued: the blocks its schedule registered hold no
        K/V. Their hashes go, and the sequences holding them (the one that was to compute them and
        any that took them from the prefix cache) recompute from their tokens."""
        dropped = self.blocks.forget_unlaunched()
        if dropped:
            for seq in reversed(self.scheduler.running):  # latest first: the queue keeps their order
                if not dropped.isdisjoint(seq.block_table):
                    self.scheduler.requeue(seq)

    def _finish_reason(self, seq: Sequence, token: int, num_tokens: int) -> str | None:
        if seq.detokenizer is not None and seq.detokenizer.stopped:
            return "stop"
        if token in self.eos_ids and not seq.params.ignore_eos:
            return "stop"
        if num_tokens >= seq.max_num_tokens:
            return "length"
        return None

    @staticmethod
    def flush_text(seq: Sequence) -> str:
        """Text the detokenizer still holds back (partial characters, a possible stop string)."""
        return seq.detokenizer.flush() if seq.detokenizer else ""

    def completion_text(self, seq: Sequence) -> str:
        if seq.detokenizer is not None:
            return seq.detokenizer.text
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = False) -> list[dict]:
        """A dict per prompt: "text", "token_ids", "finish_reason" and "logprobs" (a TokenLogprobs
        per token, or None unless asked for) of its first sample; with n > 1, "samples" lists all
        n as such dicts (else None)."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        # Every prompt is checked before any is queued, so a bad one leaves nothing behind.
        firsts = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        groups = [[first, *first.forks] for first in firsts]
        seqs = [s for group in groups for s in group]
        for seq in firsts:
            self.enqueue(seq)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm  # optional: a progress bar only when asked for
            bar = tqdm(total=len(seqs), desc="Generating", dynamic_ncols=True)
        try:
            while not all(s.is_finished for s in seqs):
                done = sum(o.finished for o in self.step())
                if bar is not None:
                    bar.update(done)
        except BaseException:
            for s in seqs:
                self.abort(s)
            raise
        finally:
            if bar is not None:
                bar.close()
        results = []
        for group in groups:
            samples = [self._result(s) for s in group]
            results.append({**samples[0], "samples": samples if len(group) > 1 else None})
        return results

    def _result(self, seq: Sequence) -> dict:
        return {"text": self.completion_text(seq), "token_ids": seq.completion_token_ids,
                "finish_reason": seq.finish_reason, "logprobs": seq.logprobs}

    # --- introspection and lifetime --------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_blocks=self.blocks.num_blocks, block_size=self.block_size,
            num_free_blocks=self.blocks.num_free_blocks, num_cached_blocks=self.blocks.num_cached_blocks,
            prefix_hit_tokens=s.prefix_hit_tokens, prompt_tokens=s.prompt_tokens,
            num_running=len(s.running), num_waiting=len(s.waiting), num_preemptions=s.num_preemptions,
            **self._tier_stats())

    def _tier_stats(self) -> dict:
        tiers = self.tiers
        if tiers is None:
            return {}
        disk = tiers.disk
        return dict(host_hit_tokens=tiers.host_hit_tokens, disk_hit_tokens=tiers.disk_hit_tokens,
                    host_blocks=len(tiers.host), host_capacity_blocks=tiers.host.num_slots,
                    disk_bytes=disk.bytes if disk else 0, disk_capacity_bytes=disk.cap_bytes if disk else 0)

    def shutdown(self) -> None:
        """Frees the model and the KV cache; with a disk directory, first writes the cached blocks
        the disk lacks, so that the next start finds them."""
        if self._closed:
            return
        self._closed = True
        self._inflight = None
        if not getattr(self.runner, "broken", False):
            try:
                self.flush_disk_cache()
            except Exception:
                pass  # a cache: what could not be written is computed again next time
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
