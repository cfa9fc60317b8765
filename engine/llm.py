"""The engine's front door: LLM holds the model runner, the scheduler and the tokenizer, and runs
requests step by step. generate() is the batch API; add_request()/step()/abort() are what the
streaming EngineThread drives."""
import threading
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.step_plan import plan_step
from engine.tokenizer import eos_token_ids, load_tokenizer


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


class LLM:
    def __init__(self, model, *, device=None, dtype=None, tensor_parallel_size=1, max_model_len=4096,
                 max_num_seqs=512, max_num_batched_tokens=16384, kvcache_block_size=None, num_kvcache_blocks=None,
                 gpu_memory_utilization=0.9, enforce_eager=False, attention_backend=None, max_prefill_chunk=None,
                 load_format="safetensors", prefill_cuda_graphs=None, progress=None):
        """progress: optional callable taking one string, told each start-up stage (for a UI)."""
        self._progress = progress or (lambda message: None)
        self._progress("reading the model config")
        self.config = EngineConfig.create(
            model, device=device, dtype=dtype, tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            kvcache_block_size=kvcache_block_size, num_kvcache_blocks=num_kvcache_blocks,
            gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
            attention_backend=attention_backend, max_prefill_chunk=max_prefill_chunk, load_format=load_format,
            prefill_cuda_graphs=prefill_cuda_graphs)
        self._progress("loading the tokenizer")
        self.tokenizer = load_tokenizer(self.config.model_path)
        self._tokenizer_lock = threading.Lock()
        self.eos_ids = eos_token_ids(self.config.model_path, self.tokenizer, self.config.hf_config)
        self.runner = self._make_runner()
        self.block_size = self.config.block_size
        self.blocks = BlockManager(self.runner.num_blocks, self.block_size)
        self.scheduler = Scheduler(self.blocks, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.max_prefill_chunk)
        self._closed = False
        self.last_step_tokens = (0, 0)  # (prefill, decode) tokens run by the last step

    def _make_runner(self):
        if self.config.tensor_parallel_size > 1:
            from engine.tp_group import TensorParallelRunner
            return TensorParallelRunner(self.config, progress=self._progress)
        from engine.model_runner import ModelRunner
        return ModelRunner(self.config, progress=self._progress)

    # --- requests ------------------------------------------------------------------------------

    def encode(self, prompt) -> list[int]:
        """A prompt as token ids, checked against the model and cache limits (ValueError if not)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            if self.tokenizer is None:
                raise ValueError(f"model at {self.config.model_path} has no tokenizer: pass token ids, not text")
            with self._tokenizer_lock:
                ids = self.tokenizer.encode(prompt)
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

    def render_chat(self, messages: list[dict], enable_thinking: bool | None = None) -> str:
        """Chat messages as prompt text through the tokenizer's chat template."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model at {self.config.model_path} has no chat template")
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("chat messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        extra = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
        with self._tokenizer_lock:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)

    def make_sequence(self, prompt, params: SamplingParams | None = None, *, stream: bool = False) -> Sequence:
        """A checked, tokenized request, not yet queued; safe to call from any thread. With
        stream=True the sequence is detokenized step by step and step() reports its new text."""
        if self._closed:
            raise RuntimeError("this LLM has been shut down")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        seq = Sequence(self.encode(prompt), params, self.block_size)
        if (stream or params.stop) and self.tokenizer is not None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, self._tokenizer_lock)
        return seq

    def enqueue(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def add_request(self, prompt, params: SamplingParams | None = None, *, stream: bool = False) -> Sequence:
        seq = self.make_sequence(prompt, params, stream=stream)
        self.enqueue(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # --- stepping --------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        batch, cut_short = self.scheduler.schedule()
        outputs = []
        for seq in cut_short:
            self.scheduler.finish(seq, "length")
            outputs.append(StepOutput(seq, [], self.flush_text(seq), True))
        self.last_step_tokens = (0, 0)
        if not batch:
            return outputs
        plan = plan_step(batch, self.block_size)
        tokens = iter(self.runner.execute(plan))
        # Runs for every sequence of every step: the GPU idles through it, so it stays lean.
        commit = self.blocks.commit_full_blocks
        decode = 0
        for seq, n in batch:
            if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                decode += 1
            seq.num_computed_tokens += n
            commit(seq)
            if seq.num_computed_tokens < len(seq.token_ids):
                continue  # a prompt chunk that does not reach the end samples nothing
            token = next(tokens)
            seq.token_ids.append(token)
            text = seq.detokenizer.push([token]) if seq.detokenizer else ""
            reason = self._finish_reason(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                text += self.flush_text(seq)
            outputs.append(StepOutput(seq, [token], text, reason is not None))
        self.last_step_tokens = (len(plan.input_ids) - decode, decode)
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if seq.detokenizer is not None and seq.detokenizer.stopped:
            return "stop"
        params = seq.params
        if token in self.eos_ids and not params.ignore_eos:
            return "stop"
        num_tokens = len(seq.token_ids)
        if num_tokens - seq.num_prompt_tokens >= params.max_tokens or num_tokens >= self.config.max_model_len:
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
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        # Every prompt is checked before any is queued, so a bad one leaves nothing behind.
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            self.enqueue(seq)
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
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
        return [{"text": self.completion_text(s), "token_ids": s.completion_token_ids,
                 "finish_reason": s.finish_reason} for s in seqs]

    # --- introspection and lifetime --------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_blocks=self.blocks.num_blocks, block_size=self.block_size,
            num_free_blocks=self.blocks.num_free_blocks, num_cached_blocks=self.blocks.num_cached_blocks,
            prefix_hit_tokens=s.prefix_hit_tokens, prompt_tokens=s.prompt_tokens,
            num_running=len(s.running), num_waiting=len(s.waiting), num_preemptions=s.num_preemptions)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
