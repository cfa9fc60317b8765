"""CUDA graphs for decode steps, fed by one host-to-device copy, with sampling captured as well.

The point is how few torch calls a decode step makes. Each one lets go of the GIL and has to win
it back. While the app's UI thread draws, each win costs the engine thread tens of µs, so a busy
UI slows generation in proportion to the calls per step, not only their own host time: beside a
thread running Python in 40 ms bursts, 8 streams kept 81% of their rate at the general path's ~32
torch calls a step and 88% at six (bench_gil_contention, H200). Here a decode step makes six:
- the host writes all of a step's inputs, at the fixed offsets of its bucket, into a pinned
  buffer (plain memory writes, no torch call), and one copy moves them to the device;
- the captured graph reads them where they land, and takes each pending input id (a token the
  step before is still sampling) from the runner's token buffer on the device;
- on a single GPU a second, small graph per bucket and kind of sampling computes the logits and
  samples into that token buffer;
- rows with penalties, min_p, logit_bias, min_tokens or structured output sample in an "adjusted"
  kind of that graph, which applies them as the eager Sampler does (SamplingParams' order), from
  per-row settings staged with the rest and from each sequence's token counts, kept on the device
  in a slot of their own (_CountSlots): built once when the sequence takes the slot, then one added
  per sampled token by the graph itself. A step that rebuilt no slot makes no more torch calls than
  a plain one;
- a step with rows under structured output replays its forward pass at once and its sampling
  graph later (sample_masked), once the host has computed the rows' token masks (LLM.step) and
  copied them to the device: the unconstrained rows keep the graphs, and the masks cost one copy;
- the runner then queues the tokens' copy to the host and records an event, and later waits on
  it.

Padding rows (a bucket holds more rows than the step has) write no K/V (slot -1), read one
cached token, sample greedily, and nothing reads what they produce.
"""
import math
from array import array

import torch

from engine.core.step_plan import StepPlan
from engine.layers.attention import AttentionMetadata
from engine.runner.sampler import TOP_K_WIDTH, _beyond_top_k, _draw_from, draw, filter_width, top_p_alone
from engine.runner.step_graphs import capture_graph

# Tokens a row may have banned at once (min_tokens' end-of-sequence ids) in the adjusted kinds, and
# logit_bias entries per request; a row with more samples on the runner.
BAN_WIDTH = 4
BIAS_WIDTH = 64
# Per-row inputs, in layout order: name, dtype, array typecode, the value of a padding row (which
# leaves the logits as they are), values per row. The adjusted kinds read the fields from
# "repetition" on; "slot" is the row's token-count slot, 0 (all zeros, never written) for a row
# without penalties or logit_bias. A row's "banned" ids repeat its first one (or are 0 with "ban"
# off), so that writing them back in one scatter never writes one token twice with different values.
# "mask_row" is the row's token mask in DecodeGraphs.masks, 0 (every token allowed, never written)
# for a row not under structured output. "attention_order" lists the rows in the order the
# attention starts them (StepPlan.longest_first), padding rows last, each at its own index (its pad
# is the row's index, ROW_INDEX: a field of one value a row).
ROW_INDEX = object()
_FIELDS = (("input_ids", torch.int64, "q", 0, 1), ("positions", torch.int64, "q", 0, 1),
           ("slot_mapping", torch.int64, "q", -1, 1), ("feed_from", torch.int64, "q", -1, 1),
           ("context_lens", torch.int32, "i", 1, 1), ("attention_order", torch.int32, "i", ROW_INDEX, 1),
           ("temperatures", torch.float32, "f", 1.0, 1),
           ("top_p", torch.float32, "f", 1.0, 1), ("top_k", torch.int32, "i", 0, 1), ("greedy", torch.bool, "B", 1, 1),
           ("repetition", torch.float32, "f", 1.0, 1), ("frequency", torch.float32, "f", 0.0, 1),
           ("presence", torch.float32, "f", 0.0, 1), ("log_min_p", torch.float32, "f", -math.inf, 1),
           ("slot", torch.int64, "q", 0, 1), ("banned", torch.int64, "q", 0, BAN_WIDTH), ("ban", torch.bool, "B", 0, 1),
           ("mask_row", torch.int64, "q", 0, 1))
# What the forward pass and the plain kinds read: a step of those leaves the rest as it was.
_PLAIN_FIELDS = _FIELDS[:[name for name, *_ in _FIELDS].index("repetition")]
ADJUSTED = "adjusted_"
# "filter" ranks the whole vocabulary for top-k/top-p, "narrow_filter" a row's TOP_K_WIDTH largest logits
# (sampler.filter_width), "top_p" draws top-p without top-k with kernels.top_p_sampling, on a GPU
# (sampler.top_p_alone).
SAMPLE_KINDS = ("greedy", "sample", "filter", "narrow_filter", "top_p",
                ADJUSTED + "greedy", ADJUSTED + "sample", ADJUSTED + "filter", ADJUSTED + "narrow_filter",
                ADJUSTED + "top_p")
_BLOCK_ZERO = bytes(4)
# Sampling graphs hold their logits and the sort of top-k/top-p in the graph pool for good; past
# this many rows a step's GPU time dwarfs the host time they save.
SAMPLE_GRAPH_ROWS = 64
# Pinned input buffers, used in turn. The step before the one being staged may not have copied its
# inputs yet (the overlapped step), nor, when an error dropped a step in flight unread
# (LLM._fail_inflight), the one before it; the step three back has: its tokens were read back
# first. A tensor-parallel worker is as far along: rank 0 sends it a plan only after reading the
# tokens of the step two back, which needed the worker's part of that step.
_RING = 3
# int32 on the device; any top_k from the vocabulary size up keeps every token.
_TOP_K_MAX = 2**31 - 1


_NO_BANS = array("q", [0]) * BAN_WIDTH


def _to_device(values: array, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.frombuffer(values, dtype=dtype) if len(values) else torch.empty(0, dtype=dtype)
    if device.type != "cuda":
        return host
    # Pinned and non-blocking: the copy queues behind the step's forward pass instead of waiting
    # for it.
    return host.pin_memory().to(device, non_blocking=True)


class _CountSlots:
    """Which sequence's token counts each device slot (1 to `slots`; 0 is the neutral one) holds,
    and how many of its tokens they count. Slots go to sequences as their rows need them; when all
    are taken, the one least recently used by a step goes (its sequence, if it comes back, has its
    counts built again). A step has at most as many rows as slots, so its own rows never lose one."""

    def __init__(self, slots: int):
        self._free = list(range(slots, 0, -1))
        self._held: dict[int, list[int]] = {}  # seq_id -> [slot, tokens counted, last step]

    def claim(self, seq_id: int, counted: int | None, step: int) -> tuple[int, bool]:
        """The sequence's slot, for a row whose counts must cover `counted` tokens (its history and
        its input token; None: a row without penalties, whose counts nothing reads), and whether
        the slot must be built first; the row's sampled token makes it one more."""
        held = self._held.get(seq_id)
        if held is None:
            slot = self._free.pop() if self._free else self._evict(step)
            held = self._held[seq_id] = [slot, -1, step]
            fresh = True
        else:
            fresh = counted is not None and held[1] != counted
        held[1], held[2] = None if counted is None else counted + 1, step
        return held[0], fresh

    def _evict(self, step: int) -> int:
        seq_id = min((s for s, held in self._held.items() if held[2] != step), key=lambda s: self._held[s][2])
        return self._held.pop(seq_id)[0]

    def follow(self, seq_id: int, counted: int | None) -> int | None:
        """The sequence's slot when its counts cover exactly `counted` tokens, now one more (a
        token sampled elsewhere is to be added); else None, the slot given up unless its counts
        are not read (counted None)."""
        held = self._held.get(seq_id)
        if held is None or counted is None:
            return None
        if held[1] == counted:
            held[1] += 1
            return held[0]
        del self._held[seq_id]
        self._free.append(held[0])
        return None

    def __bool__(self) -> bool:
        return bool(self._held)


def _aligned(n: int) -> int:
    # Each input starts 16-byte aligned, as its own allocation would: Triton specializes kernels
    # on pointer alignment.
    return n + (-n % 16)


class _Layout:
    """Where each input of a bucket of `rows` lies in the staged bytes: the per-row fields, then
    the block tables as rows of `width` int32 block ids."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self.offsets, at = {}, 0
        for name, dtype, _, _, per_row in _FIELDS:
            self.offsets[name] = at
            at = _aligned(at + rows * per_row * dtype.itemsize)
        self.tables = at
        self.nbytes = at + rows * width * 4

    def views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {}
        for name, dtype, _, _, width in _FIELDS:
            at = self.offsets[name]
            view = region[at:at + self.rows * width * dtype.itemsize].view(dtype)
            out[name] = view.view(self.rows, width) if width > 1 else view
        out["block_tables"] = region[self.tables:self.nbytes].view(torch.int32).view(self.rows, self.width)
        return out


def adjust_logits_torch(logits, slot, mask_row, masks, counts, prompt_seen, repetition, frequency, presence,
                        bias_ids, bias_values, banned, ban) -> torch.Tensor:
    """kernels.adjust_logits in torch operations (its arguments and result; the CPU's path and
    the kernel's reference): logit_bias, token masks, bans, then penalties, for every row."""
    logits = logits.clone() if logits.dtype == torch.float32 else logits.float()
    logits.scatter_add_(1, bias_ids.index_select(0, slot), bias_values.index_select(0, slot))
    # The masks read as bytes (little-endian words: token t is bit t % 8 of byte t // 8), so that
    # unpacking them writes a byte per token, not an int32.
    mask_bytes = masks.index_select(0, mask_row).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((mask_bytes[:, :, None] >> shifts) & 1).view(torch.bool).view(len(mask_bytes), -1)
    logits = logits.masked_fill(~allowed[:, :logits.shape[-1]], float("-inf"))
    kept = logits.gather(1, banned)
    banned_logits = logits.scatter(1, banned, kept.masked_fill(ban[:, None], float("-inf")))
    # As the eager Sampler: a row that the bans would leave with no token keeps its end.
    logits = torch.where(torch.isfinite(banned_logits).any(-1, keepdim=True), banned_logits, logits)
    counts = counts.index_select(0, slot)
    in_completion = counts > 0
    seen = prompt_seen.index_select(0, slot) | in_completion
    repetition = repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * in_completion.float()


def _argmax(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """logits.argmax(-1), on a GPU by kernels.temperature_draw.greedy_tokens (written into out
    when given, as torch's is copied there)."""
    if not logits.is_cuda:
        return logits.argmax(-1)
    from kernels.temperature_draw import greedy_tokens  # start-up: Triton loads only where it runs
    return greedy_tokens(logits, out)


class DecodeGraphs:
    def __init__(self, model, *, buckets: list[int], max_blocks_per_seq: int, hidden_size: int,
                 sampled: torch.Tensor, device, dtype, sample: bool, vocab_size: int):
        """sampled: the runner's token buffer (int64, a row per sequence of the largest step): each
        step's tokens land in it, and the next step's pending input ids come from it. sample:
        capture sampling graphs too (a single GPU: with tensor parallelism the logits are a
        collective, and the sampling stays with the runner). vocab_size: the logits' width."""
        if sampled.shape[0] < buckets[-1]:
            raise ValueError(f"a token buffer of {sampled.shape[0]} rows cannot hold a bucket of {buckets[-1]}")
        self.model = model
        self.buckets = buckets
        self.sampled = sampled
        self.device = device
        self.layouts = {b: _Layout(b, max_blocks_per_seq) for b in buckets}
        size = max(layout.nbytes for layout in self.layouts.values())
        # One device region that every bucket's graph reads from its start.
        self.region = torch.zeros(size, dtype=torch.uint8, device=device)
        self.views = {b: self.layouts[b].views(self.region) for b in buckets}
        self._staging = [torch.zeros(size, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(_RING)]
        self._staging_bytes = [memoryview(t.numpy()) for t in self._staging]
        # The copy of each bucket's bytes from each staging buffer, its slices taken once.
        self._copies = {(i, b): (self.region[:layout.nbytes], staging[:layout.nbytes])
                        for i, staging in enumerate(self._staging) for b, layout in self.layouts.items()}
        self._next = 0
        self._pads = {name: array(code, range(buckets[-1])) if pad is ROW_INDEX
                      else array(code, [pad]) * (buckets[-1] * width) for name, _, code, pad, width in _FIELDS}
        self._cu_seqlens_q = torch.arange(buckets[-1] + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(buckets[-1], hidden_size, dtype=dtype, device=device)
        # Each row's input token as the graph saw it (fed ones included), for the eager sampler's
        # penalties: the last token of each sequence.
        self.input_ids = torch.zeros(buckets[-1], dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sample_graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self._sampling = sample
        self._params_key = None
        self._params_bytes: dict[str, array] = {}
        self._kind: str | None = None
        self._adjusted = False
        self._counted: list[bool] = []
        # The adjusted kinds' token counts, a slot per sequence (row 0 the neutral slot, zeros that
        # nothing writes): counts in the completion (frequency and presence) as int32, and whether
        # a token is in the prompt (with counts > 0: repetition's "seen") as bool, 5 bytes per
        # token and slot; with its logit_bias as BIAS_WIDTH (id, value) pairs, padded with 0.0 on
        # token 0. Only as many slots as the sampling graphs have rows: 65 x 151,936 vocabulary is
        # 49 MB, where float32 for 512 rows would be 311 MB.
        self.vocab_size = vocab_size
        slots = min(SAMPLE_GRAPH_ROWS, buckets[-1]) if sample else 0
        self.counts = torch.zeros(slots + 1, vocab_size, dtype=torch.int32, device=device)
        self.prompt_seen = torch.zeros(slots + 1, vocab_size, dtype=torch.bool, device=device)
        self.bias_ids = torch.zeros(slots + 1, BIAS_WIDTH, dtype=torch.int64, device=device)
        self.bias_values = torch.zeros(slots + 1, BIAS_WIDTH, dtype=torch.float32, device=device)
        self._slots = _CountSlots(slots)
        self._builds: list = []  # (slot, row, SampleContext, logit_bias) to build before the step samples
        self._step = 0
        # Structured output's token masks, packed 32 tokens to an int32 word as the grammars give
        # them: row 0 allows every token and is never written; a step's constrained rows take rows
        # 1, 2, ... in row order. Filled on the host in pinned buffers used in turn, as the inputs.
        words = -(-vocab_size // 32)
        self.masks = torch.full((slots + 1, words), -1, dtype=torch.int32, device=device)
        self._mask_staging = [torch.full((slots + 1, words), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
                              for _ in range(_RING if slots else 0)]
        self._next_mask = 0
        self._masked_rows = 0  # the constrained rows of the step staged last
        # The sampling graphs' Exp(1) noise on a GPU comes from this seed, which each draw advances
        # on the device (kernels.exponential_noise says why). Its start comes from torch's CPU RNG:
        # torch.manual_seed before the engine is built repeats its draws, one called later does not
        # reach them (a request's own seed does: those rows sample on the runner).
        self.noise_seed = (torch.randint(0, 2**62, (1,), dtype=torch.int64).to(device)
                           if device.type == "cuda" else None)
        # Kernels were launched outside the graphs since the last forward replay (by the runner's
        # eager steps, or _build_counts): the next forward replay restores the graphs' PDL overlap
        # first (kernels.pdl.restore_graph_overlap).
        self.eager_kernels_since_replay = True

    def bucket_for(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    # --- the host side ---------------------------------------------------------------------------------

    def stage(self, plan: StepPlan, bucket: int) -> str | None:
        """Writes the plan's inputs for `bucket` and queues their copy to the device. Returns the
        kind of sampling a graph can do for it, or None: the runner samples (a seeded row, whose
        draw keys on its own generator, or no sampling graph for this bucket)."""
        i = self._next
        self._next = (i + 1) % _RING
        out, layout = self._staging_bytes[i], self.layouts[bucket]
        rows = len(plan.input_ids)
        feed_from = [-1] * rows
        for row, src in zip(plan.feed_rows, plan.feed_from):
            feed_from[row] = src
        # Sampling settings only where a sampling graph may read them: tensor-parallel workers get
        # plans without them, and rank 0 samples on the runner, as it does past the sampling
        # graphs' sizes.
        sampling = self._sampling and len(plan.sample_params) == rows and bucket <= SAMPLE_GRAPH_ROWS
        kind = self._stage_params(plan) if sampling else None
        values = {"input_ids": plan.input_ids, "positions": plan.positions, "slot_mapping": plan.slot_mapping,
                  "feed_from": feed_from, "context_lens": plan.context_lens, "attention_order": plan.longest_first}
        for name, dtype, code, _, width in _FIELDS if kind is not None and self._adjusted else _PLAIN_FIELDS:
            at, size = layout.offsets[name], dtype.itemsize * width
            data = array(code, values[name]) if name in values else self._params_bytes.get(name) if sampling else None
            filled = 0 if data is None else rows
            if data is not None:
                out[at:at + rows * size] = memoryview(data).cast("B")
            if filled < bucket:
                out[at + filled * size:at + bucket * size] = \
                    memoryview(self._pads[name]).cast("B")[filled * size:bucket * size]
        # Each row's block ids; past them the row keeps whatever the buffer held (another bucket's
        # bytes), which no kernel reads. A padding row reads its first block: block 0.
        row_bytes = 4 * layout.width
        for row, table in enumerate(plan.block_tables):
            at = layout.tables + row * row_bytes
            ids = table if isinstance(table, array) else array("i", table)
            out[at:at + 4 * len(ids)] = memoryview(ids).cast("B")
        for row in range(rows, bucket):
            at = layout.tables + row * row_bytes
            out[at:at + 4] = _BLOCK_ZERO
        region, staged = self._copies[(i, bucket)]
        region.copy_(staged, non_blocking=True)
        return kind

    def _stage_params(self, plan: StepPlan) -> str | None:
        """The per-row sampling settings as bytes (kept while the rows keep their settings, as
        streams do from step to step); returns the kind of sampling, None for what the runner's
        eager Sampler does, for the whole step: a seeded row, logprobs, more logit_bias entries than
        BIAS_WIDTH or bans than BAN_WIDTH. Rows with penalties, min_p, logit_bias, min_tokens or
        structured output make it an adjusted kind."""
        params = plan.sample_params
        key = [(p.temperature, p.top_k, p.top_p, p.seed is None) if p.plain else
               (p.temperature, p.top_k, p.top_p, p.seed is None, p.repetition_penalty, p.frequency_penalty,
                p.presence_penalty, p.min_p, p.logprobs, p.structured_output is None, len(p.logit_bias or ()))
               for p in params]
        if key != self._params_key:
            greedy = [p.temperature == 0 for p in params]
            self._masked_rows = 0
            self._params_bytes = {
                "temperatures": array("f", [1.0 if g else p.temperature for p, g in zip(params, greedy)]),
                "top_p": array("f", [p.top_p for p in params]),
                "top_k": array("i", [min(p.top_k, _TOP_K_MAX) for p in params]),
                "greedy": array("B", greedy)}
            self._adjusted = not all(p.plain for p in params)
            # The rows that hold a slot: their counts or their logit_bias live there.
            self._counted = [p.has_penalties or bool(p.logit_bias) for p in params]
            if any((not g and p.seed is not None) or p.logprobs is not None
                   or len(p.logit_bias or ()) > BIAS_WIDTH for p, g in zip(params, greedy)):
                self._kind = None
            elif all(greedy):
                self._kind = "greedy"
            elif any(p.top_k > 0 or p.top_p < 1 for p in params):
                if self.device.type == "cuda" and top_p_alone(params, self.vocab_size):
                    self._kind = "top_p"
                elif filter_width(params, self.vocab_size) < self.vocab_size:
                    self._kind = "narrow_filter"
                else:
                    self._kind = "filter"
            else:
                self._kind = "sample"
            if self._adjusted and self._kind is not None:
                self._params_bytes.update(
                    repetition=array("f", [p.repetition_penalty for p in params]),
                    frequency=array("f", [p.frequency_penalty for p in params]),
                    presence=array("f", [p.presence_penalty for p in params]),
                    log_min_p=array("f", [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]))
                mask_rows = array("q", bytes(8 * len(params)))
                masked = 0
                for row, p in enumerate(params):
                    if p.structured_output is not None:
                        masked += 1
                        mask_rows[row] = masked
                self._params_bytes["mask_row"] = mask_rows
                self._masked_rows = masked
                self._kind = ADJUSTED + self._kind
            self._params_key = key
        if self._kind is None or not self._adjusted:
            return self._kind
        return self._kind if self._stage_counts(plan) else None

    def _stage_counts(self, plan: StepPlan) -> bool:
        """Each adjusted row's bans and token-count slot, claimed for its sequence (a slot whose
        counts do not cover the row's tokens is built before the step samples, in replay()).
        False, claiming nothing, when a row needs what the graphs lack (then the runner samples)."""
        vocab = self.vocab_size
        contexts = plan.sample_contexts
        bans = {}
        for row, c in enumerate(contexts):
            if c is not None:
                if c.banned:
                    bans[row] = ids = [t for t in c.banned if t < vocab]
                    if len(ids) > BAN_WIDTH:
                        return False
                if c.seq_id is None and self._counted[row]:
                    return False
        self._step += 1
        slots, ban = array("q"), array("B", bytes(len(contexts)))
        banned = _NO_BANS * len(contexts)
        for row, ids in bans.items():
            if ids:
                ban[row] = 1
                banned[row * BAN_WIDTH:(row + 1) * BAN_WIDTH] = array("q", ids + [ids[0]] * (BAN_WIDTH - len(ids)))
        for row, (c, counted) in enumerate(zip(contexts, self._counted)):
            if not counted:
                slots.append(0)
                continue
            slot, fresh = self._slots.claim(c.seq_id, c.num_history + 1 if c.tokens is not None else None, self._step)
            slots.append(slot)
            if fresh:
                self._builds.append((slot, row, c, plan.sample_params[row].logit_bias))
        self._params_bytes.update(slot=slots, banned=banned, ban=ban)
        return True

    def follow(self, contexts, tokens: torch.Tensor) -> None:
        """Adds the tokens the runner sampled (eagerly: a prompt's last chunk beside decode rows, a
        step with a row the graphs cannot sample) to the counts of the rows' sequences that hold a
        slot; a slot whose counts do not cover the row's tokens is given up (the sequence's next
        adjusted step builds it again)."""
        if not self._slots:
            return
        rows, cells = array("q"), array("q")
        for row, c in enumerate(contexts):
            if c is not None and c.seq_id is not None:
                slot = self._slots.follow(c.seq_id, c.num_history + 1 if c.tokens is not None else None)
                if slot is not None:
                    rows.append(row)
                    cells.append(slot * self.vocab_size)
        if rows:
            at = _to_device(cells, torch.int64, self.device) + tokens.index_select(0, _to_device(rows, torch.int64,
                                                                                                   self.device))
            self.counts.view(-1).index_add_(0, at, torch.ones(len(rows), dtype=torch.int32, device=self.device))

    def stage_padding(self, bucket: int) -> None:
        """Fills the bucket's inputs with padding rows only, so a replay writes no K/V. At start-up
        only: the copy waits, as capturing runs ahead of any ring of staging buffers."""
        i = self._next
        self._next = (i + 1) % _RING
        out, layout = self._staging_bytes[i], self.layouts[bucket]
        for name, dtype, _, _, width in _FIELDS:
            at, size = layout.offsets[name], bucket * width * dtype.itemsize
            out[at:at + size] = memoryview(self._pads[name]).cast("B")[:size]
        out[layout.tables:layout.nbytes] = bytes(layout.nbytes - layout.tables)
        region, staged = self._copies[(i, bucket)]
        region.copy_(staged)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- the device side -------------------------------------------------------------------------------

    def _forward(self, bucket: int) -> None:
        v = self.views[bucket]
        input_ids = self.input_ids[:bucket]
        if input_ids.is_cuda:
            # A rehearsal that skips this launch (not compiled yet: kernels/warm_start.py) leaves
            # the buffer's earlier tokens, of the vocabulary, for the embedding to index by.
            from kernels.fed_tokens import fed_tokens  # start-up: Triton loads only where it runs
            fed_tokens(v["feed_from"], self.sampled, v["input_ids"], input_ids)
        else:
            fed = v["feed_from"] >= 0
            fed_token = self.sampled.index_select(0, v["feed_from"].clamp(min=0))
            input_ids.copy_(torch.where(fed, fed_token, v["input_ids"]))
        meta = AttentionMetadata(slot_mapping=v["slot_mapping"], context_lens=v["context_lens"],
                                 block_tables=v["block_tables"], cu_seqlens_q=self._cu_seqlens_q[:bucket + 1],
                                 max_seqlen_q=1, is_decode=True, seq_order=v["attention_order"])
        self.hidden[:bucket] = self.model(input_ids, v["positions"], meta)

    def _build_counts(self) -> None:
        """Builds the token counts (and logit_bias) of the slots stage() gave out fresh, as the
        eager Sampler counts a row's tokens: its history from the host, its input token (which the
        step before may have sampled) from the forward pass's input ids. Runs between the forward
        and the sampling graph, eagerly: once per sequence taking a slot, not per step."""
        builds, self._builds = self._builds, []
        self.eager_kernels_since_replay = True
        vocab, device = self.vocab_size, self.device
        slots, rows, after_prompt = array("q"), array("q"), array("B")
        prompt, completion, prompt_counts, completion_counts = array("q"), array("q"), array("q"), array("q")
        bias_ids, bias_values = array("q"), array("f")
        for slot, row, c, bias in builds:
            slots.append(slot)
            rows.append(row)
            history = c.history if c.tokens is not None else array("q")
            n = c.num_prompt_tokens
            prompt += history[:n]
            completion += history[n:]
            prompt_counts.append(min(n, len(history)))
            completion_counts.append(max(len(history) - n, 0))
            after_prompt.append(len(history) >= n)
            entries = list(bias.items()) if bias else []
            bias_ids += array("q", [t for t, _ in entries] + [0] * (BIAS_WIDTH - len(entries)))
            bias_values += array("f", [b for _, b in entries] + [0.0] * (BIAS_WIDTH - len(entries)))
        at = _to_device(slots, torch.int64, device)
        self.counts.index_fill_(0, at, 0)
        self.prompt_seen.index_fill_(0, at, False)
        flat_counts, flat_seen = self.counts.view(-1), self.prompt_seen.view(-1)
        # Output sizes given: computing them on the device would wait for it.
        owner = torch.repeat_interleave(at, _to_device(prompt_counts, torch.int64, device), output_size=len(prompt))
        flat_seen.index_fill_(0, owner * vocab + _to_device(prompt, torch.int64, device), True)
        owner = torch.repeat_interleave(at, _to_device(completion_counts, torch.int64, device),
                                        output_size=len(completion))
        flat_counts.index_add_(0, owner * vocab + _to_device(completion, torch.int64, device),
                               torch.ones(len(completion), dtype=torch.int32, device=device))
        # The input token: in the completion unless the row is the prompt's last token (a decode
        # step after the prefix cache held all the rest).
        cell = at * vocab + self.input_ids.index_select(0, _to_device(rows, torch.int64, device))
        in_completion = _to_device(after_prompt, torch.bool, device)
        flat_counts.index_add_(0, cell, in_completion.int())
        flat_seen.index_put_((cell,), flat_seen[cell] | ~in_completion)
        self.bias_ids[at] = _to_device(bias_ids, torch.int64, device).view(len(builds), BIAS_WIDTH)
        self.bias_values[at] = _to_device(bias_values, torch.float32, device).view(len(builds), BIAS_WIDTH)

    def _adjust(self, logits: torch.Tensor, v: dict[str, torch.Tensor]) -> torch.Tensor:
        """Sampler.adjust_logits for every row at once, from the staged settings, the slots'
        counts and the token masks: a row with neutral settings (slot 0, mask row 0, no bans) comes
        out exactly as it went in. On a GPU in two kernels (kernels/adjust_logits.py), elsewhere in
        torch operations."""
        args = (logits, v["slot"], v["mask_row"], self.masks, self.counts, self.prompt_seen, v["repetition"],
                v["frequency"], v["presence"], self.bias_ids, self.bias_values, v["banned"], v["ban"])
        if logits.is_cuda:
            from kernels.adjust_logits import adjust_logits  # start-up: Triton loads only where it runs
            return adjust_logits(*args)
        return adjust_logits_torch(*args)

    def _sample(self, bucket: int, kind: str) -> None:
        v = self.views[bucket]
        logits = self.model.compute_logits(self.hidden[:bucket])
        adjusted = kind.startswith(ADJUSTED)
        kind = kind.removeprefix(ADJUSTED)
        filters = None
        if kind in ("filter", "narrow_filter"):
            width = min(TOP_K_WIDTH, logits.shape[-1]) if kind == "narrow_filter" else logits.shape[-1]
            filters = (_beyond_top_k(v["top_k"], width), v["top_p"][:, None])
        elif kind == "top_p":
            # The kernel runs where graphs do; elsewhere (rehearsals on CPU) the sort keeps the same.
            mask = None if logits.is_cuda else _beyond_top_k(torch.zeros_like(v["top_k"]), logits.shape[-1])
            filters = (mask, v["top_p"][:, None])
        out = self.sampled[:bucket]
        if adjusted:
            # Sampler.sample's order for rows that are not plain: adjust, scale, cut by min_p, draw.
            logits = self._adjust(logits, v)
            if kind == "greedy":
                tokens = _argmax(logits, out)
            else:
                scaled = logits / v["temperatures"][:, None]
                scaled = scaled.masked_fill(scaled < scaled.max(-1, keepdim=True).values + v["log_min_p"][:, None],
                                            float("-inf"))
                tokens = _draw_from(scaled, _argmax(logits, out), v["greedy"], filters, (), None, self._noise(logits))
        elif kind == "greedy":
            tokens = _argmax(logits, out)
        elif kind == "sample" and logits.is_cuda:
            tokens = self._temperature_draw(logits, v, out)
        else:
            tokens = draw(logits, v["temperatures"][:, None], v["greedy"], filters, noise=self._noise(logits))
        if tokens is not out:
            out.copy_(tokens)
        if adjusted:
            # Each real slot is one row's: one more of its sampled token. Slot 0 (padding) gets
            # nothing, at cell 0 whatever its token: the start-up rehearsal skips launches not
            # compiled yet (kernels/warm_start.py) and leaves their tokens as garbage, all of them
            # padding rows'.
            slot = v["slot"]
            cells = torch.where(slot > 0, slot * self.vocab_size + out, 0)
            self.counts.view(-1).index_add_(0, cells, (slot > 0).int())

    def _temperature_draw(self, logits: torch.Tensor, v: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """draw() for the plain "sample" kind on a GPU, by kernels.temperature_draw: the tokens
        draw() takes from _noise's tensor, without that tensor or the logits' float32 copies,
        written into out."""
        from kernels.temperature_draw import temperature_draw  # start-up: Triton loads only where it runs
        tokens = temperature_draw(logits, v["temperatures"], self.noise_seed, greedy=v["greedy"], out=out)
        self.noise_seed.add_(1)
        return tokens

    def _noise(self, logits: torch.Tensor):
        """draw()'s noise for this step's rows: on a GPU from kernels.exponential_noise and
        noise_seed, which it then advances; None elsewhere (torch's exponential_, as the eager
        Sampler draws)."""
        if not logits.is_cuda:
            return None

        def noise(shape):
            from kernels.exponential_noise import exponential_noise  # start-up: Triton loads only where it runs
            out = exponential_noise(shape, self.noise_seed)
            self.noise_seed.add_(1)
            return out
        return noise

    def _restore_overlap(self) -> None:
        if self.device.type == "cuda":
            from kernels.pdl import restore_graph_overlap  # start-up: Triton loads only where graphs run
            restore_graph_overlap(self.device)

    @torch.inference_mode()
    def rehearse(self) -> None:
        """Runs each step capture() would capture once, eagerly (ModelRunner._compile_ahead), and
        the launch that replay() makes after eager kernels, so that its kernel is compiled ahead too."""
        self._restore_overlap()
        for bucket in self.buckets:
            self.stage_padding(bucket)
            self._forward(bucket)
            if self._sampling and bucket <= SAMPLE_GRAPH_ROWS:
                for kind in SAMPLE_KINDS:
                    self._sample(bucket, kind)

    @torch.inference_mode()
    def capture(self, pool=None, progress=None):
        """Captures every bucket, largest first so the shared memory pool is sized once, then the
        sampling graphs. Returns the pool, which other graphs may share (steps never overlap)."""
        for i, bucket in enumerate(reversed(self.buckets)):
            if progress and i % 8 == 0:
                progress(f"capturing decode CUDA graphs ({i}/{len(self.buckets)})")
            self.stage_padding(bucket)
            self.graphs[bucket] = graph = capture_graph(lambda: self._forward(bucket), pool)
            pool = graph.pool()
            if self._sampling and bucket <= SAMPLE_GRAPH_ROWS:
                for kind in SAMPLE_KINDS:
                    self.sample_graphs[(bucket, kind)] = capture_graph(lambda: self._sample(bucket, kind), pool)
        # A graph's first launch also uploads it to the device: a prompt's last, small chunk took
        # 6-7 ms instead of ~2.5 in a bucket not yet replayed (H200, bench_streaming). Launch each
        # once now, on padding rows only, which write no K/V.
        for bucket, graph in self.graphs.items():
            self.stage_padding(bucket)
            graph.replay()
            for kind in SAMPLE_KINDS:
                if (bucket, kind) in self.sample_graphs:
                    self.sample_graphs[(bucket, kind)].replay()
        # And the kernel replay() launches after eager kernels: loaded now, not in the first reply.
        self._restore_overlap()
        torch.cuda.synchronize(self.device)
        return pool

    def replay(self, bucket: int, kind: str | None) -> None:
        """Runs the staged step; with a kind, samples too (stage() said which). Not captured (on a
        CPU, in tests) it runs the same code eagerly."""
        graph = self.graphs.get(bucket)
        if graph is not None:
            if self.eager_kernels_since_replay:
                self._restore_overlap()
                self.eager_kernels_since_replay = False
            graph.replay()
        else:
            self._forward(bucket)
        if kind is not None:
            self.sample(bucket, kind)

    @property
    def masked_rows(self) -> int:
        """The rows under structured output in the step staged last: its sampling waits for their
        masks (sample_masked)."""
        return self._masked_rows if self._kind is not None and self._adjusted else 0

    def mask_rows(self, count: int, words: int) -> torch.Tensor | None:
        """The pinned rows that the next sample_masked copies to the device, for the grammars to
        write the staged step's masks into (`count` rows of `words` words, every constrained row in
        row order), so that they are not copied on the host first; None for any other shape."""
        if count != self.masked_rows or not self._mask_staging or words != self.masks.shape[1]:
            return None
        return self._mask_staging[self._next_mask][1:count + 1]

    def sample_masked(self, bucket: int, kind: str, rows: list[int], masks: torch.Tensor) -> None:
        """Samples the replayed step (stage() gave `kind`) once the token masks of its constrained
        rows are known: masks[i] is row rows[i]'s (Grammars.masks' packed words), written in place
        when mask_rows() gave them. A row under structured output that `rows` leaves out (its
        sequence has ended: nothing reads its token) allows every token."""
        staging = self._mask_staging[self._next_mask]
        self._next_mask = (self._next_mask + 1) % _RING
        count = self._masked_rows
        if masks.data_ptr() != staging[1].data_ptr():  # not mask_rows()'s rows, written in place
            width = min(masks.shape[1], staging.shape[1])
            if len(rows) == count:  # every row under structured output, in row order: rows 1, 2, ...
                staging[1:count + 1, :width] = masks[:, :width]
                at = slice(1, count + 1)
            else:
                staging[1:count + 1].fill_(-1)
                mask_rows = self._params_bytes["mask_row"]  # stage() numbered the rows 1, 2, ... in row order
                at = torch.tensor([mask_rows[row] for row in rows], dtype=torch.int64)
                staging[:, :width].index_copy_(0, at, masks[:, :width])
            if width < staging.shape[1]:
                staging[at, width:] = 0  # tokens past the grammar's vocabulary (the logits' padding): never
        self.masks[1:count + 1].copy_(staging[1:count + 1], non_blocking=True)
        self.sample(bucket, kind)

    def sample(self, bucket: int, kind: str) -> None:
        """Samples the replayed step's rows into the token buffer, first building the token counts
        of any sequence that took a slot this step."""
        if self._builds:
            self._build_counts()
        graph = self.sample_graphs.get((bucket, kind))
        if graph is not None:
            graph.replay()
        else:
            self._sample(bucket, kind)
