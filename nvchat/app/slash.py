"""The app's handlers for the slash commands typed in a prompt box (their names, usage and summaries
are the table the REPL shares: nvchat/slash_table.py). Most run the action their key runs."""
from __future__ import annotations

from pathlib import Path

from textual.app import App

from nvchat.slash_table import format_stats

# The action each command runs, as its key would. With TEXT, /system, /rename and /save do without
# their dialog (run_command).
ACTIONS = {"help": "help", "new": "new_tab", "system": "system_prompt", "rename": "rename_tab",
           "save": "export_markdown", "sampling": "sampling", "stop": "stop_reply", "regenerate": "regenerate",
           "edit": "edit_last", "quit": "quit"}


def command_for_action(action: str) -> str | None:
    """'/new' for new_tab: for the help screen's key table."""
    return next((f"/{name}" for name, bound in ACTIONS.items() if bound == action), None)


async def run_command(app: App, name: str, arg: str) -> None:  # an NvchatApp
    pane = app.active_pane
    if pane is None:
        return
    if name == "stats":
        app.notify(format_stats(app.engine.stats(), pane.last_stream), title="Stats", timeout=20)
    elif name == "system" and arg:
        app.run_worker(pane.set_system_prompt(arg))
        app.notify("This chat's system prompt is set from its next turn on.")
    elif name == "rename" and arg:
        app.run_worker(pane.rename(arg))
    elif name == "save" and arg:
        app.run_worker(app.export(pane.conversation, Path(arg).expanduser()))
    elif name == "stop" and not (pane.busy or pane.editing):
        app.notify("Nothing to stop: this chat is not replying.")
    else:
        await app.run_action(ACTIONS[name])
