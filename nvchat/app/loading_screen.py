"""Start-up: the engine's stages (config, tokenizer, weights, KV cache, warm-up) as they happen,
or the reason it could not start."""
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.content import Content
from textual.screen import Screen
from textual.widgets import LoadingIndicator, Static


class LoadingScreen(Screen):
    CSS_PATH = Path(__file__).with_name("loading_screen.tcss")
    BINDINGS = [Binding("q", "leave", "Quit", show=False)]

    def __init__(self, model_label: str, note: str | None = None) -> None:
        super().__init__()
        self.model_label = model_label
        self.note = note
        self.stages: list[str] = []
        self.error: str | None = None

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static(Content.assemble(("nvchat", "bold"), "  starting ", (self.model_label, "italic")),
                         id="loading-title")
            if self.note:
                yield Static(self.note, id="loading-note", markup=False)
            yield Static(id="loading-stages")
            yield LoadingIndicator(id="loading-spinner")
            yield Static(id="loading-error")

    def add_stage(self, stage: str) -> None:
        self.stages.append(stage)
        self._redraw()

    def _redraw(self) -> None:
        lines = []
        for i, stage in enumerate(self.stages):
            mark = "  ✓ " if i < len(self.stages) - 1 else "  ✗ " if self.error else "  … "
            lines.append(Content.assemble((mark, "bold"), stage))
        self.query_one("#loading-stages", Static).update(Content("\n").join(lines))

    def action_leave(self) -> None:
        # After a failed start the reason is printed again once the terminal is back, and the
        # exit status says it failed.
        if self.error:
            self.app.exit(return_code=1, message=f"nvchat: the engine could not start: {self.error}")
        else:
            self.app.exit()

    def fail(self, error: str) -> None:
        self.error = error
        self._redraw()
        self.query_one("#loading-spinner").display = False
        box = self.query_one("#loading-error", Static)
        box.update(Content.assemble(("The engine could not start:\n", "bold"), error, "\n\nPress q to quit."))
        box.display = True
