"""Start-up: the engine's stages (config, tokenizer, weights, KV cache, warm-up) as they happen,
or the reason it could not start. What the user types meanwhile is kept for the first chat's box."""
from pathlib import Path

from textual import events
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
        self.typed = ""  # goes into the first chat's prompt box

    def compose(self) -> ComposeResult:
        with Vertical(id="loading-box"):
            yield Static(Content.assemble(("nvchat", "bold"), "  starting ", (self.model_label, "italic")),
                         id="loading-title")
            if self.note:
                yield Static(self.note, id="loading-note", markup=False)
            yield Static(id="loading-stages")
            yield LoadingIndicator(id="loading-spinner")
            yield Static(id="loading-error")
            yield Static(id="loading-typed", markup=False)

    def add_stage(self, stage: str) -> None:
        self.stages.append(stage)
        self._redraw()

    def _redraw(self) -> None:
        lines = []
        for i, stage in enumerate(self.stages):
            mark = "  ✓ " if i < len(self.stages) - 1 else "  ✗ " if self.error else "  … "
            lines.append(Content.assemble((mark, "bold"), stage))
        self.query_one("#loading-stages", Static).update(Content("\n").join(lines))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # q quits a start that failed; before that it is a letter of what the user types.
        return self.error is not None if action == "leave" else True

    def on_key(self, event: events.Key) -> None:
        if self.error is not None:
            return
        if event.is_printable:
            self._type(self.typed + event.character)
        elif event.key == "backspace":
            self._type(self.typed[:-1])

    def on_paste(self, event: events.Paste) -> None:
        if self.error is None:
            self._type(self.typed + event.text)

    def _type(self, text: str) -> None:
        self.typed = text
        box = self.query_one("#loading-typed", Static)
        box.update(f"Kept for the message box: {text}" if text else "")
        box.display = bool(text)

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
