"""The app's actions: what its keys, the command palette and the slash commands typed in a prompt box
run, which of them may run now, and the settings they change for good (saved to config.toml).

ChatActions is mixed into NvchatApp, since Textual looks an app's actions up on the app; what it
uses of the app is declared at its head. The slash commands' names, usage and summaries are the
table the REPL shares (nvchat/slash_table.py); most run the action their key runs (SLASH_ACTIONS).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from textual.screen import ModalScreen

from nvchat import paths
from nvchat.app.bindings import APP_KEYS, SLASH_ACTIONS
from nvchat.app.chat_pane import ChatPane
from nvchat.app.chat_tabs import ChatTabs
from nvchat.app.code_block import CopyableFence, copy_code
from nvchat.app.conversations_screen import ConversationsScreen
from nvchat.app.file_picker_screen import FilePickerScreen
from nvchat.app.help_screen import HelpScreen
from nvchat.app.kv_panel import KVPanel
from nvchat.app.loading_screen import LoadingScreen
from nvchat.app.rename_screen import RenameScreen
from nvchat.app.sampling_screen import SamplingScreen
from nvchat.app.services import ChatServices
from nvchat.app.stream_pump import StreamPump
from nvchat.app.system_prompt_screen import SystemPromptScreen
from nvchat.app.tool_rounds import ToolRounds
from nvchat.conversation import MAX_ALTERNATIVES, MIN_ALTERNATIVES, Conversation
from nvchat.export import export_markdown, save_markdown_to
from nvchat.settings import DEFAULT_SYSTEM_PROMPT, Settings, save_setting
from nvchat.slash_table import format_stats, sampling_changes

_BOUND_ACTIONS = {spec.action.partition("(")[0] for spec in APP_KEYS}  # names, as check_action gets them
# Actions that need a started engine and the chat screen on top.
_CHAT_ACTIONS = (_BOUND_ACTIONS - {"help", "quit", "toggle_kv_panel", "toggle_compact"}
                 | {"default_system_prompt", "copy_code", "pick_file"})


class ChatActions:
    # What the actions use of the app they are mixed into, besides Textual's App.
    settings: Settings
    keymap: dict[str, str]
    services: ChatServices
    pump: StreamPump
    tool_rounds: ToolRounds
    ready: bool  # engine and store are up, chats can run
    tabs: ChatTabs
    active_pane: ChatPane | None
    new_conversation: Callable[[], Conversation]
    save_open_tabs: Callable[[], None]
    _loading: LoadingScreen | None  # the start-up's screen, while it is up

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # The app's bindings are priority bindings: stand aside while a modal (a dialog, the
        # command palette, help) is up, so that it gets its own keys (Esc, F1, Ctrl+S...).
        # Textual's own app actions (focus_next for Tab, the palette's) stay on: a dialog needs them.
        if isinstance(self.screen, ModalScreen) and action in _BOUND_ACTIONS and action != "quit":
            return False
        if action in _CHAT_ACTIONS | {"toggle_kv_panel"} and not self.ready:
            return False
        # None: shown greyed out in the footer, and the key goes to the focused widget instead.
        if action in ("stop_reply", "regenerate", "edit_last", "select_message", "switch_branch", "alternatives",
                      "pick_alternative"):
            pane = self.active_pane
            if pane is None:
                return None
            if action == "stop_reply":
                return True if pane.busy or pane.editing or pane.cursor is not None else None
            if action == "select_message":
                return True if pane.conversation.messages else None
            if action == "alternatives":
                return None if pane.busy else True
            if action == "pick_alternative":
                return True if pane.has_alternatives else None
            return None if pane.busy or not pane.conversation.messages else True
        return True

    # --- tabs ----------------------------------------------------------------------------------------

    async def action_new_tab(self) -> None:
        await self.tabs.open(self.new_conversation())

    async def action_close_tab(self) -> None:
        pane = self.active_pane
        if pane is not None:
            await self.tabs.close(pane)
            self.pump.forget(pane)
            self.save_open_tabs()

    def action_next_tab(self) -> None:
        self.tabs.cycle(1)

    def action_previous_tab(self) -> None:
        self.tabs.cycle(-1)

    def action_rename_tab(self) -> None:
        pane = self.active_pane
        if pane is None:
            return

        def renamed(title: str | None) -> None:
            if title:
                self.run_worker(pane.rename(title))

        self.push_screen(RenameScreen(pane.conversation.title), renamed)

    def action_open_conversations(self) -> None:
        def chosen(conversation_id: int | None) -> None:
            if conversation_id is None:
                return
            for pane in self.tabs.panes:
                if pane.conversation.id == conversation_id:
                    self.tabs.show(pane)  # and if it is read-only, writable now if it can be
                    return
            self.run_worker(self._reopen(conversation_id))

        search = self.services.store.search_conversations
        self.push_screen(ConversationsScreen(lambda text: self.services.in_background(search, text)), chosen)

    async def _reopen(self, conversation_id: int) -> None:
        try:
            conversation = await self.services.in_background(Conversation.load, self.services.engine,
                                                             self.services.store, conversation_id, self.settings)
        except Exception as e:
            self.notify(str(e), title="Could not open the conversation", severity="error")
            return
        conversation.toolbox = self.tool_rounds.tools
        await self.tabs.open(conversation)

    # --- the active chat -----------------------------------------------------------------------------

    def action_stop_reply(self) -> None:
        if self.active_pane is not None:
            self.active_pane.stop()

    def action_regenerate(self) -> None:
        if self.active_pane is not None:
            self.active_pane.regenerate()

    def action_edit_last(self) -> None:
        if self.active_pane is not None:
            self.active_pane.start_edit()

    def action_select_message(self, step: int) -> None:
        if self.active_pane is not None:
            self.active_pane.move_selection(step)

    async def action_switch_branch(self, step: int) -> None:
        if self.active_pane is not None:
            await self.active_pane.switch_branch(step)

    def action_alternatives(self) -> None:
        if self.active_pane is not None:
            self.active_pane.alternatives()

    async def action_pick_alternative(self, number: int) -> None:
        if self.active_pane is not None:
            await self.active_pane.pick_alternative(number)

    def action_system_prompt(self) -> None:
        pane = self.active_pane
        if pane is None:
            return

        def edited(text: str | None) -> None:
            if text is not None:
                self.run_worker(pane.set_system_prompt(text))

        self.push_screen(SystemPromptScreen(f"System prompt for “{pane.conversation.title}”",
                                            pane.conversation.system_prompt, self.settings.system_prompt), edited)

    def action_sampling(self) -> None:
        pane = self.active_pane
        if pane is None:
            return
        defaults = pane.conversation.sampling_defaults()  # the dialog's fields, each as the chat follows it

        def chosen(sampling: dict | None) -> None:
            if sampling is not None:
                self.run_worker(pane.set_sampling(sampling))

        self.push_screen(SamplingScreen(f"Sampling for “{pane.conversation.title}”",
                                        defaults | pane.conversation.sampling, defaults), chosen)

    def action_pick_file(self) -> None:
        pane = self.active_pane
        if pane is None:
            return

        root = Path.cwd()

        def picked(path: Path | None) -> None:
            if path is not None:  # named in the message as it would be typed after /file
                self.run_worker(pane.attach_file(str(path.relative_to(root) if path.is_relative_to(root) else path)))

        self.push_screen(FilePickerScreen(root), picked)

    def action_export_markdown(self) -> None:
        if self.active_pane is not None:
            self.run_worker(self.export(self.active_pane.conversation))

    async def export(self, conversation: Conversation, path: Path | None = None) -> None:
        """To path (/save PATH; a directory gets a generated name), else into the current directory
        or, where that can't be written, nvchat's exports directory."""
        if not conversation.messages:
            self.notify("Nothing to export yet.", severity="warning")
            return
        try:
            if path is None:
                path = await self.services.in_background(export_markdown, conversation,
                                                         [Path.cwd(), paths.exports_dir()])
            else:
                path = await self.services.in_background(save_markdown_to, conversation, path)
        except OSError as e:
            self.notify(str(e), title="Export failed", severity="error")
            return
        self.notify(str(path), title="Exported to Markdown", timeout=10)

    def action_copy_code(self) -> None:
        """The focused code block, else the active chat's latest one."""
        fence = self.focused if isinstance(self.focused, CopyableFence) else None
        if fence is None and self.active_pane is not None:
            fences = self.active_pane.query(CopyableFence)
            fence = fences.last() if fences else None
        if fence is None:
            self.notify("No code block in this chat yet.", severity="warning")
            return
        copy_code(fence)

    # --- the app -------------------------------------------------------------------------------------

    def action_toggle_kv_panel(self) -> None:
        panel = self.query_one(KVPanel)
        panel.set_shown(not panel.display)

    def action_toggle_compact(self) -> None:
        compact = not self.settings.compact_transcript
        self.settings.compact_transcript = compact
        self.set_class(compact, "-compact")
        self.run_worker(self.save_setting("compact_transcript", compact))

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.keymap))

    async def action_quit(self) -> None:
        if self._loading is not None and self._loading.error:
            self._loading.action_leave()  # as q there: the exit status and message say the start failed
        else:
            await super().action_quit()

    # --- slash commands ------------------------------------------------------------------------------

    async def run_slash_command(self, name: str, arg: str) -> None:
        pane = self.active_pane
        if pane is None:
            return
        if name == "stats":
            pane.show_note(format_stats(self.services.engine.stats(), pane.last_stream), "stats-note")
        elif name == "system" and arg:
            self.run_worker(pane.set_system_prompt(arg))
            self.notify("This chat's system prompt is set from its next turn on.")
        elif name == "rename" and arg:
            self.run_worker(pane.rename(arg))
        elif name == "file" and arg:
            self.run_worker(pane.attach_file(arg, typed=f"/file {arg}"))
        elif name == "sampling" and arg:
            self._sampling_command(pane, arg)
        elif name == "save" and arg:
            self.run_worker(self.export(pane.conversation, Path(arg).expanduser()))
        elif name == "stop" and not (pane.busy or pane.editing):
            self.notify("Nothing to stop: this chat is not replying.")
        elif name == "branch" and arg:
            await self._branch_command(pane, arg)
        elif name == "alt" and arg:
            count = _number(arg)
            if count is None or not MIN_ALTERNATIVES <= count <= MAX_ALTERNATIVES:
                self.notify(f"/alt takes how many replies: {MIN_ALTERNATIVES} to {MAX_ALTERNATIVES}, not {arg!r}.",
                            severity="warning")
            else:
                pane.alternatives(count)
        elif name == "pick":
            number = _number(arg)
            if number is None:
                self.notify("/pick takes the number of the alternative to keep, e.g. /pick 2.", severity="warning")
            else:
                await pane.pick_alternative(number)
        else:
            await self.run_action(SLASH_ACTIONS[name])

    def _sampling_command(self, pane: ChatPane, arg: str) -> None:
        """/sampling NAME=VALUE...: this chat's own values, checked before they are kept; reset: none."""
        conversation = pane.conversation
        try:
            sampling = ({} if arg.lower() == "reset" else
                        conversation.sampling | sampling_changes(arg, conversation.sampling_defaults()))
            conversation.check_sampling(sampling)
        except ValueError as e:
            self.notify(str(e), title="Sampling not changed", severity="warning")
            return
        self.run_worker(pane.set_sampling(sampling))

    async def _branch_command(self, pane: ChatPane, arg: str) -> None:
        word = arg.lower()
        if word in ("next", "prev", "previous"):
            await pane.switch_branch(1 if word == "next" else -1)
        elif _number(arg) is not None:
            await pane.switch_branch(number=_number(arg))
        else:
            self.notify(f"/branch takes a branch's number, next or prev, not {arg!r}.", severity="warning")

    # --- settings that persist -----------------------------------------------------------------------

    def action_default_system_prompt(self) -> None:
        def edited(text: str | None) -> None:
            if text is not None:
                self.settings.system_prompt = text
                self.run_worker(self.save_setting("system_prompt", text, "New chats will use this system prompt."))

        self.push_screen(SystemPromptScreen("Default system prompt for new chats", self.settings.system_prompt,
                                            DEFAULT_SYSTEM_PROMPT), edited)

    async def save_setting(self, name: str, value, done: str | None = None) -> None:
        """Saves a setting to config.toml, on the conversation thread; done: said once it is saved."""
        try:
            await self.services.in_background(save_setting, name, value)
        except (ValueError, OSError) as e:  # SettingsError, and a config.toml edited into invalid TOML
            self.notify(str(e), title="Could not save the setting", severity="error")
            return
        if done:
            self.notify(done)


def _number(text: str) -> int | None:
    return int(text) if text.strip().isdigit() else None
