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
- the runner then queues the tokens' copy to the host and records an event, and later waits on
  it.

Padding rows (a bucket holds more rows than the step has) write no K/V (slot -1), read one
cached token, sample greedily, and nothing reads what they produce.
"""
from array import array

import torch

from engine.core.step_plan import StepPlan
from engine.layers.attention import AttentionMetadata
from engine.runner.sampler import _beyond_top_k, draw
from engine.runner.step_graphs import capture_graph

# Per-row inputs, in layout order: name, dtype, array typecode, the value of a padding row.
_FIELDS = (("input_ids", torch.int64, "q", 0), ("positions", torch.int64, "q", 0),
           ("slot_mapping", torch.int64, "q", -1), ("feed_from", torch.int64, "q", -1),
           ("context_lens", torch.int32, "i", 1), ("temperatures", torch.float32, "f", 1.0),
           ("top_p", torch.float32, "f", 1.0), ("top_k", torch.int32, "i", 0), ("greedy", torch.bool, "B", 1))
SAMPLE_KINDS = ("greedy", "sample", "filter")
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
        for name, dtype, _, _ in _FIELDS:
            self.offsets[name] = at
            at = _aligned(at + rows * dtype.itemsize)
        self.tables = at
        self.nbytes = at + rows * width * 4

    def views(self, region: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {name: region[self.offsets[name]:self.offsets[name] + self.rows * dtype.itemsize].view(dtype)
               for name, dtype, _, _ in _FIELDS}
        out["block_tables"] = region[self.tables:self.nbytes].view(torch.int32).view(self.rows, self.width)
        return out


class DecodeGraphs:
    def __init__(self, model, *, buckets: list[int], max_blocks_per_seq: int, hidden_size: int,
                 sampled: torch.Tensor, device, dtype, sample: bool):
        """sampled: the runner's token buffer (int64, a row per sequence of the largest step): each
        step's tokens land in it, and the next step's pending input ids come from it. sample:
        capture sampling graphs too (a single GPU: with tensor parallelism the logits are a
        collective, and the sampling stays with the runner)."""
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
        self._pads = {name: array(code, [pad]) * buckets[-1] for name, _, code, pad in _FIELDS}
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
        # plans without them, and rank 0 samples on the runner.
        sampling = self._sampling and len(plan.sample_params) == rows
        kind = self._stage_params(plan) if sampling else None
        values = {"input_ids": plan.input_ids, "positions": plan.positions, "slot_mapping": plan.slot_mapping,
                  "feed_from": feed_from, "context_lens": plan.context_lens}
        for name, dtype, code, _ in _FIELDS:
            at, size = layout.offsets[name], dtype.itemsize
            data = array(code, values[name]) if name in values else self._params_bytes[name] if sampling else None
            filled = 0 if data is None else rows
            if data is not None:
                out[at:at + rows * size] = memoryview(data).cast("B")
            if filled < bucket:
                out[at + filled * size:at + bucket * size] = \
                    memoryview(self._pads[name]).cast("B")[:(bucket - filled) * size]
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
        return kind if self._sampling and bucket <= SAMPLE_GRAPH_ROWS else None

    def _stage_params(self, plan: StepPlan) -> str | None:
        """The per-row sampling settings as bytes (kept while the rows keep their settings, as
        streams do from step to step); returns the kind of sampling, None for a seeded row or one
        whose params are not plain (penalties, min_p, logit_bias, min_tokens, logprobs, structured
        output: the runner's eager Sampler does those, for the whole step)."""
        params = plan.sample_params
        key = [(p.temperature, p.top_k, p.top_p, p.seed is None, p.plain) for p in params]
        if key != self._params_key:
            greedy = [p.temperature == 0 for p in params]
            self._params_bytes = {
                "temperatures": array("f", [1.0 if g else p.temperature for p, g in zip(params, greedy)]),
                "top_p": array("f", [p.top_p for p in params]), "top_k": array("i", [min(p.top_k, _TOP_K_MAX) for p in params]),
                "greedy": array("B", greedy)}
            if any((not g and p.seed is not None) or not p.plain for p, g in zip(params, greedy)):
                self._kind = None
            elif all(greedy):
                self._kind = "greedy"
            elif any(p.top_k > 0 or p.top_p < 1 for p in params):
                self._kind = "filter"
            else:
                self._kind = "sample"
            self._params_key = key
        return self._kind

    def stage_padding(self, bucket: int) -> None:
        """Fills the bucket's inputs with padding rows only, so a replay writes no K/V. At start-up
        only: the copy waits, as capturing runs ahead of any ring of staging buffers."""
        i = self._next
        self._next = (i + 1) % _RING
        out, layout = self._staging_bytes[i], self.layouts[bucket]
        for name, dtype, _, _ in _FIELDS:
            at = layout.offsets[name]
            out[at:at + bucket * dtype.itemsize] = memoryview(self._pads[name]).cast("B")[:bucket * dtype.itemsize]
        out[layout.tables:layout.nbytes] = bytes(layout.nbytes - layout.tables)
        region, staged = self._copies[(i, bucket)]
        region.copy_(staged)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # --- the device side -------------------------------------------------------------------------------

    def _forward(self, bucket: int) -> None:
        v = self.views[bucket]
        fed = v["feed_from"] >= 0
        input_ids = torch.where(fed, self.sampled.index_select(0, v["feed_from"].clamp(min=0)), v["input_ids"])
        self.input_ids[:bucket].copy_(input_ids)
        meta = AttentionMetadata(slot_mapping=v["slot_mapping"], context_lens=v["context_lens"],
                                 block_tables=v["block_tables"], cu_seqlens_q=self._cu_seqlens_q[:bucket + 1],
                                 max_seqlen_q=1, is_decode=True)
        self.hidden[:bucket] = self.model(input_ids, v["positions"], meta)

    def _sample(self, bucket: int, kind: str) -> None:
        v = self.views[bucket]
        logits = self.model.compute_logits(self.hidden[:bucket])
        if kind == "greedy":
            tokens = logits.argmax(-1)
        else:
            filters = (_beyond_top_k(v["top_k"], logits.shape[-1]), v["top_p"][:, None]) if kind == "filter" else None
            tokens = draw(logits, v["temperatures"][:, None], v["greedy"], filters)
        self.sampled[:bucket].copy_(tokens)

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
        torch.cuda.synchronize(self.device)
        return pool

    def replay(self, bucket: int, kind: str | None) -> None:
        """Runs the staged step; with a kind, samples too (stage() said which). Not captured (on a
        CPU, in tests) it runs the same code eagerly."""
        graph = self.graphs.get(bucket)
        if graph is not None:
            graph.replay()
        else:
            self._forward(bucket)
        if kind is not None:
            graph = self.sample_graphs.get((bucket, kind))
            if graph is not None:
                graph.replay()
            else:
                self._sample(bucket, kind)
