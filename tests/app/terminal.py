"""A minimal terminal for the app tests: applies the updates an app sends (as its driver would
write them) to a grid of cells, so a test can compare what the terminal shows with what a full
render of the screen draws."""
from __future__ import annotations

from rich.cells import cell_len
from rich.segment import ControlType, Segment
from textual._compositor import CompositorUpdate


def cells_of(segments, width: int, height: int, grid: list[list] | None = None) -> list[list]:
    """Writes segments (text and cursor moves) into grid (a fresh blank one by default)."""
    if grid is None:
        grid = [[(" ", None)] * width for _ in range(height)]
    x = y = 0
    for segment in segments:
        if segment.control:
            for code, *args in segment.control:
                if code == ControlType.CURSOR_MOVE_TO:
                    x, y = args
            continue
        for ch in segment.text:
            if ch == "\n":
                x, y = 0, y + 1
                continue
            if 0 <= y < height and 0 <= x < width:
                grid[y][x] = (ch, segment.style)
            x += max(1, cell_len(ch))
    return grid


class RecordingTerminal:
    """Attach to an app before it runs: records every update the app would write to its terminal."""

    def __init__(self, app) -> None:
        self.app = app
        self.grid: list[list] | None = None
        self.updates = 0
        display = app._display

        def recording_display(screen, renderable) -> None:
            # As App._display: no output for nothing, nor while a batch holds updates back.
            if renderable is not None and not app._batch_count and isinstance(renderable, CompositorUpdate):
                self._apply(renderable)
            display(screen, renderable)

        app._display = recording_display

    def _apply(self, update: CompositorUpdate) -> None:
        width, height = self.app.size
        console = self.app.console
        if self.grid is None:
            self.grid = [[(" ", None)] * width for _ in range(height)]
        cells_of(console.render(update, console.options), width, height, self.grid)
        self.updates += 1

    def shown(self) -> list[str]:
        return ["".join(ch for ch, _ in row) for row in self.grid]

    def differences(self) -> list[str]:
        """Rows where the terminal differs from a full render of the current screen (text or style)."""
        width, height = self.app.size
        strips = self.app.screen._compositor.render_strips()
        segments = []
        for y, strip in enumerate(strips):
            segments.append(Segment("", None, [(ControlType.CURSOR_MOVE_TO, 0, y)]))
            segments.extend(strip)
        expected = cells_of(segments, width, height)
        return [f"row {y}: shown {''.join(c for c, _ in got)!r}, drawn {''.join(c for c, _ in want)!r}"
                for y, (got, want) in enumerate(zip(self.grid, expected)) if got != want]
