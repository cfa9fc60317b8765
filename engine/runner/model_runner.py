"""Holds the model and its KV cache on one device (one tensor-parallel rank) and runs step plans."""
import bisect
import os
from array import array

import torch

from engine.checkpoints.gguf_paths import is_gguf
from engine.checkpoints.loader import init_random_weights, load_weights
from engine.checkpoints.quantization import fp8_block
from engine.checkpoints.weight_cache import CacheMismatch, WeightCache
from engine.config import EngineConfig
from engine.core.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.core.step_plan import KVTransfers, SampleContext, StepPlan
from engine.distributed import collectives
from engine.layers import fp8
from engine.layers.attention import AttentionMetadata
from engine.layers.attention_backends import make_backend
from engine.models.cpu_decode import CpuDecode
from engine.runner.decode_graphs import DecodeGraphs
from engine.runner.kv_tiers import DiskStore, KVTierCopies, kv_fingerprint
from engine.runner.memory_plan_cache import MemoryPlanCache, plan_key
from engine.runner.sampler import Sampler
from engine.runner.step_graphs import StepGraphs, decode_buckets, prefill_buckets

# On CPU the cache has no free-memory figure to size against: cover this many full-length
# sequences, within a fraction of RAM.
_CPU_KV_SEQS = 32
_CPU_KV_MAX_BYTES = 4 << 30
# Prefill graphs hold this many sequence slots at most; bigger mixed batches run eagerly (they are
# decode-heavy, and their GPU time hides the launch cost anyway). Every slot costs the prefill
# kernel programs that find no queries and exit: at 64 slots a 128-token mixed step paid ~2 ms
# for them on the H200 (profile_step), more than a chat's handful of tabs ever needs.
_PREFILL_GRAPH_SEQS = 16
# Decode graphs and the logits ladder stop at this many rows; bigger decode steps run eagerly.
_DECODE_GRAPH_ROWS = 512
# The costliest sampling a step can ask for (the penalties' counts, logprobs' log_softmax and top 20,
# a sort over the vocabulary for top-k/top-p), which the warmup runs to size the KV cache around
# its memory.
_COSTLIEST_SAMPLING = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                                     frequency_penalty=0.1, logprobs=MAX_LOGPROBS)
# Its context: the penalties' token counts are [rows, vocab] whatever the history's length.
_COSTLIEST_CONTEXT = SampleContext(array("q"), 0)
# The CUDA devices whose first engine in this process has compiled its kernels ahead
# (ModelRunner._start_compile_workers).
_DEVICES_REHEARSED: set[int] = set()


class SampledTokens:
    """One step's sampled tokens, one per sampled row, as the host will read them, and their
    log-probabilities when a row asked for them. On a GPU their copy to pinned memory is queued
    without waiting: tolist() waits for that copy, not for anything queued after it."""

    def __init__(self, values, copied: "torch.cuda.Event | None" = None, still_mine=None, logprobs=None):
        self._values = values  # anything with tolist(): pinned memory seen through numpy, or a CPU tensor
        self._copied = copied
        self._still_mine = still_mine  # () -> False once a later step was given the same buffer
        self._logprobs = logprobs  # (chosen, top ids, top values) host tensors, or None

    def tolist(self) -> list[int]:
        if self._copied is not None:
            self._copied.synchronize()
        values = self._values.tolist()
        if self._still_mine is not None and not self._still_mine():
            raise RuntimeError("a step's sampled tokens were read after a later step reused their buffer: "
                               "read each step's tokens before launching the step after the next")
        return values

    def logprobs(self) -> tuple[list[float], list[list[int]], list[list[float]]] | None:
        """Per row: the chosen token's log-probability, and the top tokens' ids and values (as many
        as the row's request wants lead the lists). None when no row asked. Call after tolist()."""
        if self._logprobs is None:
            return None
        return tuple(t.tolist() for t in self._logprobs)


class _TokenReadback:
    """Pinned buffers that steps' tokens are copied into, used in turn. Two are enough: a step's
    tokens are read (LLM._settle) before the step after the next one is launched."""

    def __init__(self, rows: int):
        self._host = [torch.zeros(rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._arrays = [t.numpy() for t in self._host]
        self._events = [torch.cuda.Event() for _ in range(2)]
        self._queued = 0  # steps queued so far; step n (from 0) uses buffer n % 2

    def queue(self, tokens: torch.Tensor, logprobs=None) -> SampledTokens:
        step = self._queued
        self._queued += 1
        i = step % 2
        rows = tokens.shape[0]
        self._host[i][:rows].copy_(tokens, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            # Rare enough (a request that asked) for pinned tensors of their own; torch's host
            # allocator keeps them for the next step that asks.
            host_logprobs = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                  for t in (logprobs.chosen, logprobs.top_ids, logprobs.top_values))
        self._events[i].record()
        # Step n's buffer goes to step n + 2.
        return SampledTokens(self._arrays[i][:rows], self._events[i], lambda: self._queued <= step + 2,
                             host_logprobs)


def _use_expandable_segments() -> None:
    """Lets the CUDA allocator grow one segment instead of caching a segment per size. Steps come
    in many sizes (prefill chunks, batch sizes); with a segment per size the cache kept ~2 GiB more
    than any one step needs (H200, bench_memory), beyond what the KV cache's sizing set aside. A
    choice the user made in PYTORCH_CUDA_ALLOC_CONF stands."""
    chosen = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get("PYTORCH_ALLOC_CONF", "")
    if "expandable_segments" not in chosen:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def _use_cpu_threads() -> None:
    """On CPU, torch's matmuls use one thread fewer than the cores the process may run on, leaving
    one to the engine's own Python work and to an app's UI thread. With every core in torch's pool,
    each op waits at its barrier for whichever worker another thread displaced: on a 2-core box with
    other work running, batch-1 decode of SmolLM2-135M ran at 0.6 tok/s on 2 threads against 9 on 1.
    OMP_NUM_THREADS, when set, is the user's choice and stands."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores - 1))


def _cpu_ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


class ModelRunner:
    def __init__(self, config: EngineConfig, rank: int = 0, progress=None, tp_group: collectives.TPGroup | None = None):
        """tp_group: this rank's group when tensor_parallel_size > 1 (see engine.runner.tp_runner)."""
        progress = progress or (lambda message: None)
        self.config = config
        self.rank = rank
        self.block_size = config.kvcache_block_size
        # Rank r runs on the r-th GPU counted from the one asked for (cuda:2 with TP=2 is GPUs 2 and 3).
        base = config.device.index or 0
        self.device = torch.device("cuda", base + rank) if config.device.type == "cuda" else config.device
        triton_hashing = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            _use_expandable_segments()
            from kernels.warm_start import (
                hash_triton_in_background,  # start-up: the hash overlaps loading the model
            )
            triton_hashing = hash_triton_in_background()
        elif config.tensor_parallel_size == 1:  # tensor-parallel ranks share the cores out themselves
            _use_cpu_threads()
        # The warm-up's figures from an earlier start of this engine on this GPU, if any
        # (_blocks_that_fit_on_gpu).
        self._memory_plans = None
        if self.device.type == "cuda":
            self._memory_plans = MemoryPlanCache(plan_key(config, rank, self.device))
        # Started now, so that their imports overlap the model's loading; None unless this start
        # will compile its kernels ahead (_compile_ahead).
        self._compile_workers = self._start_compile_workers()
        self.tp_group = tp_group or collectives.SINGLE_RANK
        if (self.tp_group.rank, self.tp_group.size) != (rank, config.tensor_parallel_size):
            raise ValueError(f"rank {rank} of tensor_parallel_size={config.tensor_parallel_size} was given the "
                             f"group of rank {self.tp_group.rank} of {self.tp_group.size}")
        progress("building the model")
        # A block-FP8 checkpoint's weights go into FP8 parameters as they are, when they stay FP8.
        checkpoint_block = fp8_block(getattr(config.hf_config, "quantization_config", None), str(config.model_path))
        built_fp8 = config.quantization == "fp8" and checkpoint_block is not None
        self.model = self._build_model(checkpoint_block if built_fp8 else None)
        cache = self._weight_cache()
        restored = False
        if cache is not None:
            progress("loading the cached weights")
            try:
                restored = cache.restore(self.model)
            except CacheMismatch:  # deleted; the model it part-filled is built again
                self.model = self._build_model(None)
        if not restored:
            progress("loading weights")
            if config.load_format == "random":
                init_random_weights(self.model)
            else:
                load_weights(self.model, config.model_path, checkpoint_block)
            if config.quantization is not None and not built_fp8:
                self.model.quantize(config.quantization)
            if cache is not None:
                progress("caching the weights")
                cache.save(self.model)
        self.model.eval()
        self.backend = make_backend(config.attention_backend, self.device.type, config.kvcache_block_size)
        self.attention_layers = self.model.attention_layers()
        for attn in self.attention_layers:
            attn.backend = self.backend
        attn0 = self.attention_layers[0]
        self.backend.setup(config.dtype, attn0.head_dim, attn0.num_heads, attn0.num_kv_heads, self.device)
        if self.backend.name == "triton":
            # The fused Triton norm, RoPE and SiLU kernels beat torch eager on the H200 (bench_kernels,
            # 256 tokens in a CUDA graph: 6.56 / 7.46 / 6.69 µs against 25.41 / 41.92 / 12.86).
            for module in self.model.modules():
                if hasattr(type(module), "fused"):
                    module.fused = True
        if self.tp_group.size > 1:
            self.model.defer_row_parallel_sums()
        self.sampler = Sampler(self.device) if rank == 0 else None
        # Every step's sampled tokens land here, a row each: the next step takes its pending input
        # ids from it on the device. Every rank keeps them (rank 0 broadcasts its own), so that any
        # rank can feed the next step without rank 0's host in between, as the overlapped step needs.
        self.sampled = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self._readback = _TokenReadback(config.max_num_seqs) if self.device.type == "cuda" and rank == 0 else None
        # A step whose sampling waits for structured output's masks: (plan, logits, last tokens) for
        # the eager Sampler, or (plan, bucket, kind) for a decode graph's.
        self._deferred = None
        self.decode_graphs = self.prefill_graphs = None  # the warmup below runs eagerly
        self.tiers: KVTierCopies | None = None  # made with the KV cache
        self._cpu_decode: CpuDecode | None = None  # made with the KV cache, whose views it holds
        self._logits_ladder = None  # logits for exactly the rows sampled, until _warm_logits
        # On a GPU, how its memory was shared out, in bytes: "total", "used" before the KV cache,
        # what was set aside for steps ("activations") and for the graphs ("graph_pool"), what the
        # warmup left loaded outside torch's allocator ("loaded"), whether those three came from an
        # earlier start ("cached": 1), and what the graphs took once captured ("graph_pool_captured").
        # See _blocks_that_fit_on_gpu.
        self.memory_plan: dict[str, int] = {}
        # How many Triton kernel specializations the warm-up had compiled in other processes first.
        self.kernels_compiled_ahead = 0
        if triton_hashing is not None:
            triton_hashing.join()
        # Every rank must hold the same blocks: take the smallest cache any GPU has room for.
        self.num_blocks = config.num_kvcache_blocks or self.tp_group.min(self._blocks_that_fit(progress), self.device)
        if self._compile_workers is not None:
            self._compile_workers.close()
            self._compile_workers = None
        progress(f"allocating the KV cache: {self.num_blocks} blocks of {self.block_size} tokens")
        self._allocate_kv_cache(self.num_blocks)
        self.tiers = self._make_tiers()
        # Decode steps on CPU run as one loop over the layers where the model allows it.
        # Its kernels read a cache in the model's dtype only.
        if (self.device.type == "cpu" and self.backend.name == "torch" and config.kv_dtype == config.dtype
                and CpuDecode.supports(self.model)):
            self._cpu_decode = CpuDecode(self.model)
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs(progress)
        if self.device.type == "cuda":
            self._warm_logits(progress)
            # The warmup measured the steps' needs from an allocator holding no unused blocks. Start
            # them from one too: what start-up left cached (the logits just warmed, the captures'
            # eager runs) would otherwise count on top of those needs.
            self._settled_reserved()

    def _build_model(self, fp8_checkpoint_block: tuple[int, int] | None):
        """The model with its parameters allocated, not loaded. fp8_checkpoint_block: a block-FP8
        checkpoint's block shape where its weights stay FP8 (engine/checkpoints/quantization.py)."""
        config = self.config
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            with torch.device(self.device), collectives.building(self.tp_group), fp8.building(fp8_checkpoint_block):
                return config.architecture(config.hf_config, max_position=config.max_model_len)
        finally:
            torch.set_default_dtype(old_dtype)

    def _weight_cache(self) -> WeightCache | None:
        """Where a GGUF file's int4 or int8 weights are kept for the next start, on CPU and one rank
        (engine/checkpoints/weight_cache.py); None where weights are built every start."""
        config = self.config
        if (self.device.type != "cpu" or config.tensor_parallel_size != 1 or config.load_format == "random"
                or config.quantization not in ("int4", "int8")
                or not (config.model_path.is_file() and is_gguf(config.model_path))):
            return None
        return WeightCache(config.model_path, config.quantization, config.dtype)

    # --- KV cache --------------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        return self.config.kv_bytes_per_token * self.block_size

    def _blocks_that_fit(self, progress) -> int:
        c = self.config
        if self.device.type == "cpu":
            budget = min(_CPU_KV_MAX_BYTES, _cpu_ram_bytes() // 4,
                         _CPU_KV_SEQS * c.max_model_len * c.kv_bytes_per_token)
            return max(1, budget // self.block_bytes)
        return self._blocks_that_fit_on_gpu(progress)

    def _blocks_that_fit_on_gpu(self, progress) -> int:
        """Finds the memory the biggest steps and the graphs need on top of the weights (by running
        them once, or from an earlier start's measurement: engine/runner/memory_plan_cache.py),
        then gives the KV cache what is left of gpu_memory_utilization."""
        c = self.config
        plans = self._memory_plans
        needs = plans.read()
        cached = needs is not None
        if cached:
            progress("sizing the KV cache as the last start measured")
        else:
            progress("warming up to size the KV cache")
            before = self._settled_use()
            needs = self._warmup(progress)
            # What the warmup left outside torch's allocator (kernels' code, cuBLAS's workspaces),
            # which a start that skips it loads only later.
            needs["loaded"] = max(self._settled_use() - before, 0)
            plans.write(needs)
        torch.cuda.empty_cache()  # what the warmup freed is not in use: not counted as used below
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        self.memory_plan = {**needs, "total": total, "used": used, "cached": int(cached)}
        set_aside = needs["activations"] + needs["graph_pool"] + (needs["loaded"] if cached else 0)
        num_blocks = int(total * c.gpu_memory_utilization - used - set_aside) // self.block_bytes
        if num_blocks < 1:
            raise RuntimeError(
                f"no GPU memory left for the KV cache: the model uses {used / 2**30:.1f} GiB and its steps need "
                f"{set_aside / 2**30:.1f} GiB more, of {total / 2**30:.1f} GiB at gpu_memory_utilization="
                f"{c.gpu_memory_utilization}; lower max_num_batched_tokens or max_num_seqs, or raise "
                "gpu_memory_utilization")
        return num_blocks

    def _warmup(self, progress) -> dict[str, int]:
        """Runs the biggest steps the engine can take, eagerly, over a scratch KV cache. Returns the
        bytes the costliest needs beyond what stays allocated ("activations": the full prefill, the
        most rows sampled with top-k/top-p, whose sort over the vocabulary outweighs a small model's
        prefill, or a full batch of prompts' last chunks that does both in one step), and what the
        CUDA graphs to be captured will hold for good ("graph_pool")."""
        c = self.config
        tokens = min(c.max_num_batched_tokens, c.max_num_seqs * c.max_model_len)
        seq_len = min(c.max_model_len, tokens)
        num_seqs = max(1, tokens // seq_len)
        blocks_per_seq = -(-seq_len // self.block_size)
        self._allocate_kv_cache(num_seqs * blocks_per_seq)
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(num_seqs)]
        prefill = StepPlan(
            input_ids=[0] * (num_seqs * seq_len), positions=list(range(seq_len)) * num_seqs,
            slot_mapping=[-1] * (num_seqs * seq_len), cu_seqlens_q=[i * seq_len for i in range(num_seqs + 1)],
            context_lens=[seq_len] * num_seqs, block_tables=tables, sample_rows=[], sample_params=[],
            is_decode=False)
        mixed = _sampled_prefill_plan(tokens, min(c.max_num_seqs, tokens), self.block_size, num_seqs * blocks_per_seq)
        decode = _decode_plan(c.max_num_seqs, sample=True)
        if self._compile_workers is not None:
            # Triton compiles a kernel once for each way its integer arguments specialize (1, a
            # multiple of 16, any other): the steps above have round sizes, like the graphs'
            # padded ones, while a prompt prefilled eagerly (no graph holds it) has any length.
            odd_prompt = _sampled_prefill_plan(min(_ODD_PROMPT_TOKENS, seq_len), 1, self.block_size,
                                               num_seqs * blocks_per_seq)
            self._compile_ahead([prefill, decode, mixed, odd_prompt], progress)
        # In turn, without emptying the allocator's cache between them: blocks cached for one step's
        # sizes do not always fit the other's, and the cache keeps both.
        activations = self._memory_for(prefill, decode, mixed, prefill)
        graph_pool = 0 if c.enforce_eager else self._graph_pool_bytes()
        self.kv_cache = None
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
        return {"activations": activations, "graph_pool": graph_pool}

    def _start_compile_workers(self):
        """Processes to compile this start's Triton kernels in, where it will warm up and compile
        them ahead (see _compile_ahead): a start on one GPU whose KV cache is sized by a warm-up
        (the last start's figures are not cached for this key), with the Triton attention backend,
        for a dense model, and the first engine on this device in the process. The rehearsal's
        values are garbage, which nothing may take as an index: a mixture of experts sorts its
        tokens by the experts the router's kernel picked, with torch's scatter (a device-side
        assert for the 30B-A3B shape's rehearsal on an H200), and a kernel compiled for an earlier
        engine of the process would run in the rehearsal on such values. On several GPUs, ranks
        whose rehearsals skipped different launches would wait on each other's collectives."""
        c = self.config
        if self.device.type != "cuda" or c.attention_backend != "triton" or c.tensor_parallel_size > 1:
            return None
        if getattr(c.hf_config, "num_experts", 0) or torch.version.hip:  # (the workers build CUDA launchers)
            return None
        if c.num_kvcache_blocks or self.device.index in _DEVICES_REHEARSED:
            return None
        if self._memory_plans.read() is not None:
            return None
        _DEVICES_REHEARSED.add(self.device.index)
        from kernels.warm_start import (
            CompileWorkers,
            compile_worker_count,  # start-up: as the hash above
        )
        major, minor = torch.cuda.get_device_capability(self.device)
        return CompileWorkers(compile_worker_count(), ("cuda", 10 * major + minor, 32))

    def _compile_ahead(self, plans: list[StepPlan], progress) -> None:
        """Runs the warm-up's steps and the graphs' steps once, eagerly, with every launch that needs
        a compile skipped (kernels/warm_start.py), then has the compile workers compile what they
        skipped. The skipped kernels leave their outputs unwritten, so the rehearsal's values are
        garbage: the sampled tokens it leaves are cleared."""
        from kernels.warm_start import (
            uncompiled_launches,  # start-up: Triton loads only where its kernels run
        )
        progress("finding the kernels to compile")
        with uncompiled_launches() as pending:
            for plan in plans:
                self.execute(plan)
            if not self.config.enforce_eager:
                for graphs in self._uncaptured_graphs(*self._graph_buckets()):
                    if graphs is not None:
                        graphs.rehearse()
        self.sampled.zero_()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        progress(f"compiling the kernels ahead: {len(pending)} specializations")
        self.kernels_compiled_ahead = self._compile_workers.compile(pending)

    def _settled_reserved(self) -> int:
        """torch's reservation on the device once queued work has ended and unused cache went back."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def _settled_use(self) -> int:
        """What the device has given this process (and any other on it), torch's reservation or
        not, once queued work has ended and torch's unused cache went back."""
        self._settled_reserved()
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _memory_for(self, *plans: StepPlan) -> int:
        """Bytes the device must give the allocator for the plans, run in turn: their activations,
        logits and sampling buffers, as allocated at their peak, plus what the allocator loses to
        fragmentation around them. The fragmentation varies from run to run with what it holds
        cached: with Qwen3-0.6B's 256 sampled rows, reservations ran 0.013-0.080 GiB over the
        allocated peak in the warmup and 0.049-0.070 GiB (3.5-5% of it) in the GPU memory test's
        steps, on the H100 and the H200 (the GPU memory test and an allocator probe). So what the warmup saw is
        counted twice, and never less than a 16th of the allocated peak."""
        before = self._settled_reserved()
        allocated_before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        for plan in plans:
            tokens = self.execute(plan)
            if tokens is not None:
                tokens.tolist()
        torch.cuda.synchronize(self.device)
        reserved = torch.cuda.max_memory_reserved(self.device) - before
        allocated = torch.cuda.max_memory_allocated(self.device) - allocated_before
        fragmentation = max(reserved - allocated, 0)
        return allocated + max(2 * fragmentation, allocated // 16)

    def _allocate_kv_cache(self, num_blocks: int) -> None:
        attn0 = self.attention_layers[0]
        shape = (2, len(self.attention_layers), num_blocks, self.block_size, attn0.num_kv_heads, attn0.head_dim)
        # On CPU, zeroing would touch every page of a cache sized for many full-length sequences
        # (4 GiB for SmolLM2: ~9 s at start, and all of it resident). Left empty, a page is
        # committed when a token's K/V first lands on it; the CPU attention reads only the slots
        # below a sequence's length, which are always written.
        allocate = torch.zeros if self.device.type == "cuda" else torch.empty
        self.kv_cache = allocate(shape, dtype=self.config.kv_dtype, device=self.device)
        for i, attn in enumerate(self.attention_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    # --- the KV cache's lower tiers (engine/core/kv_tiers.py decides, engine/runner/kv_tiers.py copies)

    @property
    def host_slots(self) -> int:
        """Host slots of one block each (on every rank): host_cache_gib over all ranks' shards, and
        with a disk directory at least a full-length prompt's blocks, for reads from disk to land in."""
        c = self.config
        slots = int(c.host_cache_gib * 2**30) // (self.block_bytes * c.tensor_parallel_size)
        if c.disk_cache_dir is not None:
            slots = max(slots, -(-c.max_model_len // self.block_size) + 1)
        return slots

    def _make_tiers(self) -> KVTierCopies | None:
        slots = self.host_slots
        if not slots:
            return None
        block_shape = tuple(self.kv_cache.permute(2, 0, 1, 3, 4, 5).shape[1:])
        # The tiers copy blocks as they are; an FP8 cache as its bytes, since torch's index_copy_
        # has no FP8 kernel on CPU.
        cache = self.kv_cache.view(torch.uint8) if self.kv_cache.dtype.itemsize == 1 else self.kv_cache
        disk = None
        if self.config.disk_cache_dir is not None:
            disk = DiskStore(self.config.disk_cache_dir, kv_fingerprint(self.config, block_shape),
                             self.rank, block_shape, cache.dtype)
        return KVTierCopies(cache, slots, disk)

    def host_slots_allocated(self) -> int:
        return self.tiers.host.allocated_slots

    def grow_host_pool(self) -> tuple[int, bool]:
        """Allocates one more piece of the host tier's pool (HostPool.grow: call it only while no
        step runs): (slots allocated, whether more are to come)."""
        return self.tiers.grow_host()

    def transfer(self, kv: KVTransfers) -> None:
        """Queues a step's copies between the tiers, and the step stream's waits for them."""
        self.tiers.run(kv)

    def loads_done(self) -> int:
        return self.tiers.loads_done()

    def disk_files(self) -> list[tuple[int, int, float]]:
        return self.tiers.disk.files()

    def poll_tier_io(self) -> list[tuple]:
        return self.tiers.disk.poll()

    def wait_tier_io(self, timeout: float) -> None:
        self.tiers.disk.wait(timeout)

    def drain_tier_io(self) -> None:
        self.tiers.disk.drain()

    def _graph_buckets(self) -> tuple[list[int], list[int]]:
        """The decode graphs' batch sizes and the prefill graphs' token counts."""
        c = self.config
        prefill = prefill_buckets(c.max_num_batched_tokens) if c.prefill_cuda_graphs else []
        rows = min(c.max_num_seqs, _DECODE_GRAPH_ROWS, self.backend.max_graph_rows or _DECODE_GRAPH_ROWS)
        return decode_buckets(rows), prefill

    def _uncaptured_graphs(self, decode: list[int], prefill: list[int]):
        """Decode graphs for the batch sizes in decode and prefill graphs for the token counts in
        prefill (None if empty), not captured yet."""
        c = self.config
        shared = dict(model=self.model, max_blocks_per_seq=-(-c.max_model_len // self.block_size),
                      hidden_size=c.hf_config.hidden_size, device=self.device, dtype=c.dtype)
        decode_graphs = DecodeGraphs(buckets=decode, sampled=self.sampled, sample=self.tp_group.size == 1,
                                     vocab_size=c.hf_config.vocab_size, **shared)
        prefill_graphs = None
        if prefill:
            prefill_graphs = StepGraphs(token_buckets=prefill, max_seqs=min(c.max_num_seqs, _PREFILL_GRAPH_SEQS),
                                        **shared)
        return decode_graphs, prefill_graphs

    def _make_graphs(self, decode: list[int], prefill: list[int], progress=None):
        """Captures decode graphs for the batch sizes in decode and prefill graphs for the token
        counts in prefill (none if empty), all in one memory pool."""
        decode_graphs, prefill_graphs = self._uncaptured_graphs(decode, prefill)
        pool = decode_graphs.capture(progress=progress)
        if prefill_graphs is not None:
            prefill_graphs.capture(pool, progress)
        return decode_graphs, prefill_graphs

    def _graph_pool_bytes(self) -> int:
        """Memory the graphs will hold for good, found by capturing them all over the warmup's
        scratch cache and then dropping them. Counted at the device, not in torch's allocator:
        capturing the graphs of every batch size first runs kernels that only some sizes use (the
        one-row GEMV, for one), and the device memory they first take (CUDA loads code lazily)
        lies outside torch's allocator and stays after the graphs are dropped. Capturing only the largest graphs and counting torch's pool
        missed 0.027 GiB of it (H100, Qwen3-0.6B shape), which took the GPU memory test past its
        budget (by 0.032 GiB on an H200). What this first capture loads stays loaded, so it is
        also in the "used" figure measured after it: counted twice, up to ~0.13 GiB the first time
        a process builds an engine."""
        before = self._settled_use()
        graphs = self._make_graphs(*self._graph_buckets())
        # Settled, so the blocks the captures' eager warm-up runs left in the common cache go back.
        held = self._settled_use() - before
        del graphs
        torch.cuda.empty_cache()
        return held

    def _capture_graphs(self, progress) -> None:
        before = self._settled_use()
        self.decode_graphs, self.prefill_graphs = self._make_graphs(*self._graph_buckets(), progress)
        self.memory_plan["graph_pool_captured"] = self._settled_use() - before

    def _warm_logits(self, progress) -> None:
        """The logits GEMM runs outside the graphs, for as many rows as the step samples. cuBLAS
        spends ~3.5 ms on the host the first time it meets a new row count (H200: 9 rows after 8),
        which stalled every stream for one step each time a prompt's last chunk sampled beside
        them. So logits are computed for a row count from a fixed ladder (the decode graphs'
        sizes), each one met once here. Every rank runs this: the logits gather is a collective."""
        progress("warming up the logits")
        self._logits_ladder = self._graph_buckets()[0]
        hidden = torch.zeros(self._logits_ladder[-1], self.config.hf_config.hidden_size, dtype=self.config.dtype,
                             device=self.device)
        with torch.inference_mode():
            for rows in self._logits_ladder:
                self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    def logits_rows(self, rows: int) -> int:
        """How many rows a step that samples `rows` computes logits for (see _warm_logits)."""
        ladder = self._logits_ladder
        if ladder is None or rows > ladder[-1]:
            return rows
        return ladder[bisect.bisect_left(ladder, rows)]

    # --- running a step --------------------------------------------------------------------------

    def _step_inputs(self, plan: StepPlan, prefill_work=None, sample_rows=None) -> dict[str, torch.Tensor]:
        """The step's integer inputs on the device, as views of one buffer sent in one host->device
        copy: a copy per input costs a pinned allocation and a launch each, host time the GPU waits
        out. int64 for what indexes embeddings, RoPE and KV slots (a big cache has over 2**31 slot
        elements), int32 for what the attention kernels read. prefill_work: the backend's
        (items, token_splits, max_splits) for a prefill step, or None. sample_rows: the rows to take
        logits of, plan.sample_rows by default."""
        sample_rows = plan.sample_rows if sample_rows is None else sample_rows
        longs = [("input_ids", plan.input_ids), ("positions", plan.positions), ("slot_mapping", plan.slot_mapping),
                 ("sample_rows", sample_rows), ("feed_rows", plan.feed_rows), ("feed_from", plan.feed_from)]
        ints = [("context_lens", plan.context_lens), ("cu_seqlens_q", plan.cu_seqlens_q)]
        if plan.is_decode:
            ints.append(("attention_order", plan.longest_first))
        if prefill_work is not None:
            for name, values, dtype in self.backend.prefill_inputs(prefill_work):
                (longs if dtype == torch.int64 else ints).append((name, values))
        # The int64 inputs first, then the int32 ones: each group is one typed view of the buffer,
        # and each input a slice of it (a byte slice viewed as its type costs two torch calls).
        raw, spans = bytearray(), ([], [])
        for fields, code, group in ((longs, "q", spans[0]), (ints, "i", spans[1])):
            for name, values in fields:
                start = len(raw)
                raw += array(code, values)
                group.append((name, start, len(raw)))
                # Each input starts 16-byte aligned, as its own allocation would: Triton
                # specializes kernels on pointer alignment, and a step must not need a new compile.
                raw += bytes(-len(raw) % 16)
        ints_at = spans[1][0][1]
        tables_at = len(raw)
        width = self._block_tables(plan.block_tables, raw)
        buf = torch.frombuffer(raw, dtype=torch.uint8)
        if self.device.type == "cuda":
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        as_long, as_int = buf[:ints_at].view(torch.int64), buf.view(torch.int32)
        out = {name: as_long[start // 8:end // 8] for name, start, end in spans[0]}
        out.update((name, as_int[start // 4:end // 4]) for name, start, end in spans[1])
        out["block_tables"] = as_int[tables_at // 4:].view(len(plan.block_tables), width)
        return out

    @staticmethod
    def _block_tables(tables, raw: bytearray) -> int:
        """Appends the tables to raw as rows of int32 block ids zero-padded to the widest; returns
        the width. Sequences hold array('i') tables, whose bytes go in as they are."""
        width = max(map(len, tables))
        zeros = bytes(4 * width)
        for t in tables:
            raw += t if isinstance(t, array) else array("i", t)
            raw += zeros[4 * len(t):]
        return width

    def metadata(self, plan: StepPlan, inputs: dict[str, torch.Tensor], prefill_work=None) -> AttentionMetadata:
        work = self.backend.prefill_work(inputs, prefill_work) if prefill_work is not None else None
        return AttentionMetadata(
            slot_mapping=inputs["slot_mapping"],
            context_lens=inputs["context_lens"],
            block_tables=inputs["block_tables"],
            cu_seqlens_q=inputs["cu_seqlens_q"],
            max_seqlen_q=plan.max_seqlen_q,
            is_decode=plan.is_decode,
            seq_order=inputs.get("attention_order"),
            prefill_work=work,
            context=self.backend.step_context(plan, inputs, self.block_size),
        )

    def _feed(self, plan: StepPlan, inputs: dict[str, torch.Tensor]) -> None:
        """Copies the plan's pending input ids in from the tokens the step before sampled."""
        n = len(plan.input_ids)
        # feed_rows increase, so n of them are every row: with feed_from the same rows, a decode
        # batch that kept its order, one copy does what a gather and a scatter would.
        if len(plan.feed_rows) == n and plan.feed_from == plan.feed_rows:
            inputs["input_ids"].copy_(self.sampled[:n])
        else:
            inputs["input_ids"].index_copy_(0, inputs["feed_rows"], self.sampled.index_select(0, inputs["feed_from"]))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> SampledTokens | None:
        """Queues one step on the device and returns without waiting for it: rank 0 returns the
        tokens it samples, one per sampled row, others None. The plan's feed_rows take their input
        ids from the tokens the step before sampled, on the device. With plan.defer_sampling it
        queues the forward pass and the logits only, returns None, and sample_deferred() samples."""
        rows = len(plan.sample_rows)
        if plan.is_decode and self.decode_graphs is not None and rows == len(plan.input_ids):
            bucket = self.decode_graphs.bucket_for(rows)
            if bucket is not None:
                return self._execute_decode_graph(plan, bucket)
        if self.decode_graphs is not None:
            self.decode_graphs.eager_kernels_since_replay = True
        graphs = None if plan.is_decode else self.prefill_graphs
        bucket = graphs.bucket_for(len(plan.input_ids), plan.num_seqs) if graphs is not None else None
        work = None
        if not plan.is_decode:
            cu = plan.cu_seqlens_q
            work = self.backend.plan_prefill([b - a for a, b in zip(cu, cu[1:])], plan.context_lens,
                                             bucket or len(plan.input_ids))
        padded = self.logits_rows(rows) if rows else 0
        # The padding rows repeat the last sampled row: their logits are computed and never read.
        inputs = self._step_inputs(plan, work, plan.sample_rows + plan.sample_rows[-1:] * (padded - rows))
        if plan.feed_rows:
            self._feed(plan, inputs)
        meta = self.metadata(plan, inputs, work)
        if bucket is not None:
            hidden = graphs.run(bucket, inputs["input_ids"], inputs["positions"], meta)
        elif plan.is_decode and self._cpu_decode is not None and meta.context.all_slots_valid:
            hidden = self._cpu_decode(inputs["input_ids"], inputs["positions"], meta)
        else:
            hidden = self.model(inputs["input_ids"], inputs["positions"], meta)
        if not rows:
            return SampledTokens(torch.empty(0, dtype=torch.int64)) if self.rank == 0 else None
        # Rows are increasing, so as many rows as tokens means every row (a decode step): no gather
        # where the hidden states hold the padded row count already (a graph's bucket).
        if rows < len(plan.input_ids) or hidden.shape[0] != padded:
            hidden = hidden[inputs["sample_rows"]]
        last_tokens = inputs["input_ids"][inputs["sample_rows"][:rows]] if plan.sample_contexts else None
        return self._sample_or_defer(plan, self.model.compute_logits(hidden), last_tokens)

    def _execute_decode_graph(self, plan: StepPlan, bucket: int) -> SampledTokens | None:
        graphs = self.decode_graphs
        kind = graphs.stage(plan, bucket)
        if kind is not None and plan.defer_sampling:
            # Rows under structured output: the sampling graph waits for their masks.
            graphs.replay(bucket, None)
            self._deferred = (plan, bucket, kind)
            return None
        graphs.replay(bucket, kind)
        if kind is None:
            # Sampled eagerly (a seeded row, logprobs): the forward pass stayed
            # in the graph. The bucket is a size from the logits ladder: no gather, no new
            # cuBLAS shape.
            graphs.eager_kernels_since_replay = True
            last_tokens = graphs.input_ids[:len(plan.input_ids)] if plan.sample_contexts else None
            return self._sample_or_defer(plan, self.model.compute_logits(graphs.hidden[:bucket]), last_tokens)
        return self._read_back(self.sampled[:len(plan.input_ids)])

    def _sample_or_defer(self, plan: StepPlan, logits, last_tokens) -> SampledTokens | None:
        if plan.defer_sampling:
            self._deferred = (plan, logits, last_tokens)
            return None
        return self._sample(plan, logits, last_tokens)

    def mask_rows(self, count: int, words: int) -> torch.Tensor | None:
        """Host rows, [count, words] int32, for the deferred step's token masks, which
        sample_deferred then copies to the device as they are (a decode graph's pinned staging);
        None where masks may come in any tensor."""
        deferred = self._deferred
        if deferred is None or not isinstance(deferred[1], int):
            return None
        return self.decode_graphs.mask_rows(count, words)

    @torch.inference_mode()
    def sample_deferred(self, masks: tuple[list[int], torch.Tensor] | None) -> SampledTokens | None:
        """Samples the step execute() left unsampled (plan.defer_sampling), with structured
        output's token masks (Sampler.sample's masks; rank 0's only, None elsewhere), computed once
        the step before had landed. Every rank calls it, in step order: the tokens' broadcast is a
        collective."""
        if self._deferred is None:
            raise RuntimeError("sample_deferred() without a step waiting to be sampled")
        deferred, self._deferred = self._deferred, None
        plan = deferred[0]
        if isinstance(deferred[1], int):  # a decode graph's bucket and kind of sampling
            self.decode_graphs.sample_masked(deferred[1], deferred[2], *masks)
            return self._read_back(self.sampled[:len(plan.input_ids)])
        return self._sample(*deferred, masks)

    def _sample(self, plan: StepPlan, logits: torch.Tensor | None, last_tokens: torch.Tensor | None = None,
                masks=None) -> SampledTokens | None:
        """Samples the plan's rows from logits (every rank computed them: the vocabulary shards
        meet on rank 0) into self.sampled on every rank; rank 0 returns them. last_tokens: each
        sampled row's input token, when a row's SampleContext needs it (the penalties)."""
        rows = len(plan.sample_rows)
        tokens = self.sampled[:rows]
        logprobs = None
        if self.rank == 0:
            sampled, logprobs = self.sampler.sample(logits[:rows], plan.sample_params, plan.sample_positions,
                                                    plan.sample_contexts or None, last_tokens, masks)
            tokens.copy_(sampled)
            if self.decode_graphs is not None and plan.sample_contexts:
                self.decode_graphs.follow(plan.sample_contexts, tokens)
        self.tp_group.broadcast_from_rank0(tokens)
        return self._read_back(tokens, logprobs) if self.rank == 0 else None

    def _read_back(self, tokens: torch.Tensor, logprobs=None) -> SampledTokens:
        if self._readback is None:
            # Cloned: the next step overwrites self.sampled before this is read.
            return SampledTokens(tokens.clone(), logprobs=None if logprobs is None else
                                 (logprobs.chosen, logprobs.top_ids, logprobs.top_values))
        return self._readback.queue(tokens, logprobs)

    def shutdown(self) -> None:
        """Frees the model, KV cache and graphs, so the memory is there for another engine even if
        this runner object lives on."""
        self.decode_graphs = self.prefill_graphs = None
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        self._cpu_decode = None
        self.kv_cache = None
        for attn in self.attention_layers:
            attn.k_cache = attn.v_cache = torch.empty(0)
        self.attention_layers = []
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


_ODD_PROMPT_TOKENS = 17  # neither 1 nor a multiple of 16


def _sampled_prefill_plan(tokens: int, rows: int, block_size: int, num_blocks: int) -> StepPlan:
    """A prefill step of `tokens` tokens over `rows` sequences that each sample their next token,
    as a batch of prompts' last chunks does: the forward pass's activations and the sort of
    top-k/top-p in one step. It reads the scratch cache's blocks round and round and writes none."""
    per_seq = tokens // rows
    blocks = -(-per_seq // block_size)
    params = [SamplingParams(temperature=0)] + [_COSTLIEST_SAMPLING] * (rows - 1)
    return StepPlan(input_ids=[0] * (rows * per_seq), positions=list(range(per_seq)) * rows,
                    slot_mapping=[-1] * (rows * per_seq), cu_seqlens_q=[i * per_seq for i in range(rows + 1)],
                    context_lens=[per_seq] * rows,
                    block_tables=[[(i * blocks + j) % num_blocks for j in range(blocks)] for i in range(rows)],
                    sample_rows=[(i + 1) * per_seq - 1 for i in range(rows)], sample_params=params, is_decode=False,
                    sample_contexts=[None] + [_COSTLIEST_CONTEXT] * (rows - 1))


def _decode_plan(rows: int, sample: bool) -> StepPlan:
    """A decode step of `rows` one-token sequences over block 0 that writes no K/V; with sample,
    every row samples with the costliest settings but the first, which is greedy (its argmax)."""
    params = [SamplingParams(temperature=0)] + [_COSTLIEST_SAMPLING] * (rows - 1)
    return StepPlan(input_ids=[0] * rows, positions=[0] * rows, slot_mapping=[-1] * rows,
                    cu_seqlens_q=list(range(rows + 1)), context_lens=[1] * rows, block_tables=[[0]] * rows,
                    sample_rows=list(range(rows)) if sample else [], sample_params=params if sample else [],
                    is_decode=True, sample_contexts=[None] + [_COSTLIEST_CONTEXT] * (rows - 1) if sample else [])
