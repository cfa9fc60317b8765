"""A small dialog for one chat's sampling: temperature, top-p, top-k, max tokens, min-p and the
penalties. It starts from the chat's values; "Defaults" puts back what the chat follows when it sets
none (config.toml's, else the model's recommendation, else nvchat's)."""
from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from engine import SamplingParams

# (field, label, Input type)
FIELDS = (("temperature", "Temperature (0 is greedy)", "number"), ("top_p", "Top-p (0 < p ≤ 1)", "number"),
          ("top_k", "Top-k (0 is off)", "integer"), ("max_tokens", "Max tokens per reply", "integer"),
          ("min_p", "Min-p (0 is off)", "number"), ("repetition_penalty", "Repetition penalty (1 is off)", "number"),
          ("presence_penalty", "Presence penalty (-2 to 2)", "number"),
          ("frequency_penalty", "Frequency penalty (-2 to 2)", "number"))


def _shown_name(label: str) -> str:
    """A field's name as its label shows it: "Top-p" of "Top-p (0 < p ≤ 1)"."""
    return label.split(" (")[0]


class _Form(VerticalScroll, can_focus=False):
    """Scrolls to whichever field has the focus; never takes it itself (the first field does)."""


class SamplingScreen(ModalScreen[dict | None]):
    """Dismisses with the values that differ from the defaults (a chat that changed none follows
    config.toml), or None when cancelled."""

    CSS_PATH = Path(__file__).with_name("sampling_screen.tcss")
    BINDINGS = [Binding("ctrl+s", "save", "Save"), Binding("escape", "cancel", "Cancel")]

    def __init__(self, heading: str, values: dict, defaults: dict) -> None:
        super().__init__()
        self.heading = heading
        self.values = values
        self.defaults = defaults

    def compose(self) -> ComposeResult:
        # Scrolls on a short terminal, with the error and the buttons docked at its foot.
        with _Form(id="sampling-box"):
            yield Label(self.heading, id="sampling-heading")
            for name, label, kind in FIELDS:
                with Horizontal(classes="sampling-row"):
                    yield Label(label, classes="sampling-label")
                    yield Input(str(self.values[name]), type=kind, id=f"sampling-{name}", select_on_focus=True)
            with Vertical(id="sampling-foot"):
                yield Label("", id="sampling-error")
                with Horizontal(id="sampling-buttons"):
                    yield Button("Save  ^s", id="save", variant="primary")
                    yield Button("Defaults", id="defaults")
                    yield Button("Cancel  esc", id="cancel")

    def _read(self) -> dict:
        """The values, checked as the engine checks them (ValueError names a bad one)."""
        values = {}
        for name, label, kind in FIELDS:
            text = self.query_one(f"#sampling-{name}", Input).value.strip()
            try:
                values[name] = int(text) if kind == "integer" else float(text)
            except ValueError:
                raise ValueError(f"{_shown_name(label)}: {text!r} is not a number") from None
        try:
            SamplingParams(**values)
        except ValueError as e:
            # The engine names the field as the code does (top_p): say it as the label above does.
            message = str(e)
            for name, label, _ in FIELDS:
                if message.startswith(name + " "):
                    message = _shown_name(label) + message[len(name):]
                    break
            raise ValueError(message) from None
        return values

    def on_input_submitted(self) -> None:
        self.action_save()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        elif event.button.id == "defaults":
            for name, _, _ in FIELDS:
                self.query_one(f"#sampling-{name}", Input).value = str(self.defaults[name])
        else:
            self.action_cancel()

    def action_save(self) -> None:
        try:
            values = self._read()
        except ValueError as e:
            self.query_one("#sampling-error", Label).update(str(e))
            return
        self.dismiss({name: value for name, value in values.items() if value != self.defaults[name]})

    def action_cancel(self) -> None:
        self.dismiss(None)
