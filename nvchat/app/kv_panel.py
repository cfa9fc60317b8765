"""The live KV-cache panel: the engine's block map as a grid, coloured by the chat holding each
block, with counters and a throughput sparkline.

It reads the backend's stats(), a snapshot the engine publishes between steps, so refreshing it
never waits on (or slows) generation. Its timer runs only while the panel is shown.
"""
from __future__ import annotations

import math
import re
from collections import Counter, deque
from dataclasses import dataclass
from itertools import groupby, zip_longest
from typing import Callable

from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.color import Color
from textual.containers import Vertical
from textual.geometry import Region
from textual.message import Message
from textual.renderables._blend_colors import blend_colors
from textual.renderables.sparkline import Sparkline as SparklineRenderable
from textual.strip import Strip
from textual.widget import Widget
from textual.widgets import Sparkline, Static

from engine import EngineSnapshot
from engine.core.block_manager import CACHED, FREE, SHARED, USED

REFRESH_S = 0.25
NO_BLOCK_STATS = "Block statistics are not\navailable from a remote\nbackend."
_HISTORY = 80  # sparkline samples: 20 s at REFRESH_S
_USED, _SHARED, _CACHED, _FREE = "█", "▓", "░", "·"
# Block states ranked by how much they tell: a cell of several blocks shows its most telling one.
_RANK_FREE, _RANK_CACHED, _RANK_USED, _RANK_SHARED = 0, 1, 2, 3
_RANK = bytes.maketrans(bytes([FREE, CACHED, USED, SHARED]), bytes([_RANK_FREE, _RANK_CACHED, _RANK_USED, _RANK_SHARED]))
_GLYPHS = {_RANK_FREE: _FREE, _RANK_CACHED: _CACHED, _RANK_USED: _USED, _RANK_SHARED: _SHARED}
_RUNS = re.compile(rb"(.)\1*", re.DOTALL)  # runs of one byte
_UNKNOWN_OWNER = "#808080"


@dataclass(frozen=True)
class BlockOwner:
    """A chat as the panel shows it: its tab's label and colour."""
    label: str
    color: str


@dataclass
class PanelData:
    snapshot: EngineSnapshot | None  # None: a remote backend, whose blocks are not visible
    owners: dict[int, BlockOwner]  # request id -> the chat that submitted it
    chats: list[BlockOwner]  # every open chat, for the legend


@dataclass(frozen=True)
class FoldedBlocks:
    ranks: bytes  # per cell, the rank of its most telling block state (_RANK_*)
    owners: dict[int, int]  # cell -> request holding most of the cell's blocks (cells held by none absent)
    per_cell: int  # blocks per cell


def blocks_per_cell(num_blocks: int, num_cells: int) -> int:
    return max(1, math.ceil(num_blocks / max(1, num_cells)))


def fold_blocks(snapshot: EngineSnapshot, num_cells: int) -> FoldedBlocks:
    """The block map folded into at most num_cells cells. Runs several times a second on the UI
    thread over up to ~10^5 blocks, so the per-block work stays in bytes methods."""
    ranks = snapshot.block_states.translate(_RANK)
    per_cell = blocks_per_cell(len(ranks), num_cells)
    if per_cell > 1:
        # Each cell's blocks side by side as one tuple (zip of strided slices, the last cell
        # padded with free blocks): map and zip keep the per-block loop out of Python bytecode.
        ranks += bytes(-len(ranks) % per_cell)
        ranks = bytes(map(max, zip(*(ranks[k::per_cell] for k in range(per_cell)))))
    owners: dict[int, int] = {}
    most: dict[int, int] = {}
    cell_of = per_cell.__rfloordiv__
    for request_id, blocks in snapshot.block_holders.items():
        for cell, count in Counter(map(cell_of, blocks) if per_cell > 1 else blocks).items():
            if count > most.get(cell, 0):
                most[cell], owners[cell] = count, request_id
    return FoldedBlocks(ranks, owners, per_cell)


class KeptRows:
    """A widget that builds its lines once and keeps them in _rows until they change. The lines
    carry its size and the theme's colours, its background among them, so a resize or a new theme
    builds them again: a graph whose data stands still would otherwise keep the old theme's
    background after a switch (a dark strip across nvchat-light)."""

    _rows: list[Strip] | None

    def on_mount(self) -> None:
        self.app.theme_changed_signal.subscribe(self, self._theme_changed)

    def on_resize(self) -> None:
        self._rows = None

    def _theme_changed(self, _theme) -> None:
        self._rows = None
        self.refresh()


class BlockGrid(KeptRows, Widget):
    """One character per cell; a cell is one block, or several when the cache has more blocks
    than the grid has cells. Drawn with the line API from runs of like cells, so a refresh costs a
    few segments per row rather than a styled span per block."""

    class Resized(Message):
        """The grid has a new size, so the panel's legend ("1 cell = N blocks") may be stale."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.data: PanelData | None = None
        self._rows: list[Strip] | None = None

    def on_resize(self) -> None:
        super().on_resize()
        self.post_message(self.Resized())

    def show(self, data: PanelData) -> None:
        self.data = data
        if self._rows is None or not self.size:
            self.refresh()  # built when first drawn
            return
        # Only the rows that changed are drawn again: a few chats' blocks grow between refreshes.
        old, self._rows = self._rows, self._build_rows()
        changed = [y for y, (a, b) in enumerate(zip_longest(old, self._rows)) if a != b]
        if changed:
            self.refresh(Region(0, changed[0], self.size.width, changed[-1] - changed[0] + 1))

    def _build_rows(self) -> list[Strip]:
        width, height = max(1, self.size.width), max(1, self.size.height)
        base = self.rich_style
        if self.data is None:
            return [Strip([Segment("waiting for the engine…", base + Style(italic=True))])]
        folded = fold_blocks(self.data.snapshot, width * height)
        theme = self.app.current_theme
        fg = Color.parse(theme.foreground or ("#e0e0e0" if theme.dark else "#202020"))
        bg = Color.parse(theme.background or ("#000000" if theme.dark else "#ffffff"))
        styles = {_RANK_FREE: base + Style(color=fg.blend(bg, 0.6).hex),
                  _RANK_CACHED: base + Style(color=Color.parse(theme.secondary or theme.primary).hex)}
        for owner in self.data.owners.values():
            styles.setdefault(owner.color, base + Style(color=owner.color))
        styles.setdefault(_UNKNOWN_OWNER, base + Style(color=_UNKNOWN_OWNER))
        ranks, owners, request_owners = folded.ranks, folded.owners, self.data.owners

        def colour(cell: int) -> str:
            owner = request_owners.get(owners.get(cell))
            return owner.color if owner is not None else _UNKNOWN_OWNER

        rows = []
        for start in range(0, len(ranks), width):
            row, segments = ranks[start:start + width], []
            # Runs of like cells: a few segments per row rather than one per cell. Free and cached
            # runs (most of a big cache) are found by the regex alone; held ones split by chat.
            for run in _RUNS.finditer(row):
                rank, begin, end = row[run.start()], start + run.start(), start + run.end()
                if rank < _RANK_USED:
                    segments.append(Segment(_GLYPHS[rank] * (end - begin), styles[rank]))
                    continue
                for chat, cells in groupby(range(begin, end), key=colour):
                    segments.append(Segment(_GLYPHS[rank] * sum(1 for _ in cells), styles[chat]))
            rows.append(Strip(segments))
        return rows

    def render_line(self, y: int) -> Strip:
        if self._rows is None:
            self._rows = self._build_rows()
        width = self.size.width
        if y >= len(self._rows):
            return Strip.blank(width, self.rich_style)
        return self._rows[y].crop_extend(0, width, self.rich_style)


def _gib(n: int) -> str:
    gib = n / 2**30
    return f"{gib:.2f}" if gib >= 1 else f"{gib:.3f}"


def counters_text(s: EngineSnapshot) -> str:
    prefix = (f"{s.prefix_hit_rate * 100:.1f}% hit ({s.prefix_hit_tokens}/{s.prompt_tokens} tok)"
              if s.prompt_tokens else "no prompts yet")
    lines = [
        f"blocks   {s.num_used_blocks}/{s.num_blocks} used · {s.num_cached_blocks} cached",
        f"KV       {_gib(s.kv_bytes_used)}/{_gib(s.kv_bytes_total)} GiB ({s.block_size} tok/block)",
        f"prefix   {prefix}",
    ]
    # The lower tiers, where they are on: their use, and the prompt tokens that came back from each.
    if s.host_bytes_total:
        lines.append(f"host     {_gib(s.host_bytes_used)}/{_gib(s.host_bytes_total)} GiB · {s.host_hit_tokens} tok hit")
    if s.disk_bytes_total:
        lines.append(f"disk     {_gib(s.disk_bytes_used)}/{_gib(s.disk_bytes_total)} GiB · {s.disk_hit_tokens} tok hit")
    lines += [
        f"running  {s.num_running} · waiting {s.num_waiting} · preempted {s.num_preemptions}",
        f"tok/s    prefill {s.prefill_tokens_per_s:,.0f} · decode {s.decode_tokens_per_s:,.0f}",
    ]
    return "\n".join(lines)


def legend_text(chats: list[BlockOwner], per_cell: int) -> Text:
    text = Text(no_wrap=False)
    for chat in chats:
        text.append("█ ", style=chat.color)
        text.append(chat.label + "  ")
    if chats:
        text.append("\n")
    text.append(f"{_USED} used  {_SHARED} shared  {_CACHED} cached  {_FREE} free")
    if per_cell > 1:
        text.append(f"\n1 cell = {per_cell} blocks")
    return text


class ThroughputSparkline(KeptRows, Sparkline):
    """Textual's Sparkline drawn with the line API: the same bars and colours, built once per
    refresh as three strips. Its own render goes through a Rich renderable per refresh, which
    cost the UI thread more than the rest of the panel's refresh together."""

    def __init__(self, data, *, id: str | None = None) -> None:
        super().__init__(data, id=id)
        self._rows: list[Strip] | None = None
        # A column's style by its colour: building a Style was most of a column's cost, and the
        # same samples come back refresh after refresh as the history shifts by one.
        self._styles: dict[tuple, Style] = {}

    def watch_data(self) -> None:
        self._rows = None

    def _build_rows(self) -> list[Strip]:
        # As textual.renderables.sparkline.Sparkline, which this replaces.
        width, height = self.size.width, max(1, self.size.height)
        base = self.rich_style
        _, background = self.background_colors
        low = (background + self.get_component_styles("sparkline--min-color").color).rich_color
        high = (background + self.get_component_styles("sparkline--max-color").color).rich_color
        data = list(self.data or [])
        if len(data) < 2:
            glyph, color, rows = ("▁", low, 1) if not data else ("█", high, height)
            filled = Strip([Segment(glyph * width, base + Style.from_color(color))])
            return [Strip.blank(width, base)] * (height - rows) + [filled] * rows
        levels = len(SparklineRenderable.BARS)
        minimum, maximum = min(data), max(data)
        extent = maximum - minimum or 1
        buckets = tuple(SparklineRenderable._buckets(data, num_buckets=width))
        columns, index, step = [], 0.0, len(buckets) / width
        if len(self._styles) > 4 * width:
            self._styles.clear()
        for _ in range(width):
            ratio = (max(buckets[int(index)]) - minimum) / extent
            bar = int(ratio * (levels * height - 1))
            key = (base, blend_colors(low, high, ratio))
            style = self._styles.get(key)
            if style is None:
                style = self._styles[key] = base + Style.from_color(key[1])
            columns.append((bar, style))
            index += step  # accumulated, not multiplied: the float rounding picks the same buckets
        rows = []
        for row in reversed(range(height)):
            floor, top = row * levels, (row + 1) * levels
            cells = [(" ", base) if bar < floor else
                     ("█" if bar >= top else SparklineRenderable.BARS[bar % levels], style)
                     for bar, style in columns]
            runs = groupby(cells, key=lambda cell: cell[1])
            rows.append(Strip([Segment("".join(glyph for glyph, _ in run), style) for style, run in runs]))
        return rows

    def render_line(self, y: int) -> Strip:
        if self._rows is None:
            self._rows = self._build_rows()
        if y >= len(self._rows):
            return Strip.blank(self.size.width, self.rich_style)
        return self._rows[y]


class Counters(Widget):
    """Fixed-height text that repaints without asking for a new layout (Static.update would
    relayout the screen on every refresh)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.text = ""

    def show(self, text: str) -> None:
        if text != self.text:
            self.text = text
            self.refresh()

    def render(self) -> Text:
        return Text(self.text, no_wrap=True, overflow="crop")


class KVPanel(Vertical):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.source: Callable[[], PanelData] | None = None
        self._history: deque[float] = deque([0.0] * _HISTORY, maxlen=_HISTORY)
        self._grid_key = None
        self._legend: Text | None = None

    def compose(self) -> ComposeResult:
        yield Static("KV cache", id="kv-title")
        yield BlockGrid(id="kv-grid")
        yield Static(id="kv-legend")
        yield Counters(id="kv-counters")
        yield Static("throughput (tok/s)", id="kv-spark-label")
        yield ThroughputSparkline(list(self._history), id="kv-spark")

    def on_mount(self) -> None:
        self._timer = self.set_interval(REFRESH_S, self.refresh_stats, pause=not self.display)

    def set_shown(self, shown: bool) -> None:
        self.display = shown
        if shown:
            self.refresh_stats()
            self._timer.resume()
        else:
            self._timer.pause()

    def refresh_stats(self) -> None:
        if self.source is None:
            return
        data = self.source()
        snap = data.snapshot
        if snap is None:
            self._show_unavailable()
            return
        self._history.append(snap.prefill_tokens_per_s + snap.decode_tokens_per_s)
        self.query_one(Sparkline).data = list(self._history)
        counters = self.query_one(Counters)
        text = counters_text(snap)
        lines = text.count("\n") + 1
        if counters.styles.height is None or counters.styles.height.value != lines:
            counters.styles.height = lines  # a line per lower tier that is on: set once
        counters.show(text)
        grid = self.query_one(BlockGrid)
        # The engine republishes its block map only after steps: an idle engine leaves it as it was.
        key = (snap.taken_at, data.owners, data.chats, grid.size)
        if key != self._grid_key:
            self._grid_key = key
            grid.show(data)
        self._show_legend(data)

    def _show_legend(self, data: PanelData) -> None:
        grid = self.query_one(BlockGrid)
        if not grid.size:
            return  # not laid out yet (the panel was hidden): its Resized comes once it is
        per_cell = blocks_per_cell(data.snapshot.num_blocks, grid.size.width * grid.size.height)
        legend = legend_text(data.chats, per_cell)
        if legend != self._legend:
            self._legend = legend
            self.query_one("#kv-legend", Static).update(legend)

    def on_block_grid_resized(self, _message: BlockGrid.Resized) -> None:
        # The grid's size depends on the legend's height, and the legend on the grid's size; this
        # settles in a step or two, instead of showing a wrong legend until the timer's next tick.
        grid = self.query_one(BlockGrid)
        if grid.data is not None and grid.data.snapshot is not None:
            self._show_legend(grid.data)

    def _show_unavailable(self) -> None:
        if self._grid_key == NO_BLOCK_STATS:
            return
        self._grid_key = NO_BLOCK_STATS
        for part in ("#kv-grid", "#kv-legend", "#kv-spark-label", "#kv-spark"):
            self.query_one(part).display = False
        self.query_one(Counters).show(NO_BLOCK_STATS)
