"""The nvchat Textual app: chats as tabs over one backend (the in-process EngineThread, or a remote
server). NvchatApp composes the screen and wires its parts together; each job has its own module:

- services.py: the backend, the store and the conversation thread, built at start-up, shut down at exit;
- chat_tabs.py: the chats as tabs, their labels and colours, and whose each engine request is;
- stream_pump.py: the timer that moves streamed text into the visible reply, paced (pacing.py);
- tool_rounds.py: the MCP servers' tools, and a reply's tool calls: approved, run, fed back;
- actions.py: what keys, the command palette and slash commands run, and the settings they save;
- open_tabs.py: which chats were open and which had the focus, reopened at the next start.

Threads, and what runs where:
- the UI thread (Textual's event loop) only moves text into widgets;
- the engine thread steps the model and appends tokens to each RequestStream;
- one conversation thread runs everything that tokenizes or touches SQLite, in order;
- a start-up thread builds the engine, reporting each stage to the loading screen;
- the MCP thread holds the MCP servers' sessions (nvchat/mcp_tools.py).
"""
from __future__ import annotations

import asyncio
import sys
from functools import partial
from pathlib import Path

from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.widgets import Header

from engine.backend import Backend
from nvchat import startup_trace
from nvchat.app.actions import ChatActions
from nvchat.app.bindings import APP_KEYS, bindings, unknown_key_ids
from nvchat.app.chat_pane import ChatPane
from nvchat.app.chat_screen import ChatScreen
from nvchat.app.chat_tabs import ChatTabs
from nvchat.app.command_palette import ChatCommands
from nvchat.app.events import SlashCommandSubmitted
from nvchat.app.footer import ChatFooter
from nvchat.app.kv_panel import KVPanel
from nvchat.app.loading_screen import LoadingScreen
from nvchat.app.open_tabs import OpenTabs, load_open_tabs, save_open_tabs, tabs_file
from nvchat.app.services import ChatServices, quit_on_signals
from nvchat.app.stream_pump import StreamPump
from nvchat.app.tool_rounds import ToolRounds
from nvchat.backend import model_name
from nvchat.conversation import Conversation
from nvchat.default_model import GIBBERISH_NOTE
from nvchat.settings import Settings
from nvchat.store import ChatStore
from themes import load_themes

FALLBACK_THEME = "nvchat-dark"


ONE_AT_A_TIME_NOTE = "This server serves one request at a time: replies in several tabs wait for each other."


def model_label(settings: Settings, backend: Backend | None = None) -> str:
    """The model as the title bar names it: a local checkpoint by its file or folder name; a remote
    server's by the name the server gives it once it has answered, its address before."""
    if settings.uses_demo_model:
        return "demo model"
    if settings.backend is not None:
        return (backend.capabilities.model_name if backend is not None else None) or settings.model_name
    return Path(settings.model_name).name or settings.model_name


class NvchatApp(ChatActions, App[None]):
    TITLE = "nvchat"
    # Absolute, so subclasses elsewhere (the UI benchmark) still find them.
    CSS_PATH = [Path(__file__).with_name(name) for name in
                ("app.tcss", "chat_pane.tcss", "message_view.tcss", "prompt_input.tcss", "kv_panel.tcss",
                 "code_block.tcss")]
    BINDINGS = bindings(APP_KEYS)
    COMMANDS = App.COMMANDS | {ChatCommands}
    PUMP_HZ = 20  # stream pump ticks a second: the most updates a second the visible reply gets
    # Fewer while drawing is costly (DrawPacer): the UI thread aims to stay within this share of a
    # core while one chat streams, and this while several do (its time is the engine's).
    MIN_DRAW_HZ = 4
    UI_CPU_BUDGET_ONE = 0.25
    UI_CPU_BUDGET_MANY = 0.10
    # The engine thread lets go of the GIL while it waits on the GPU and must take it back to run
    # its Python; while the UI thread is busy each take waits up to one switch interval: at
    # Python's default 5 ms, 8 streams on an H200 ran 2.7x slower with the app attached
    # (bench_ui). Set while the app is mounted.
    GIL_SWITCH_INTERVAL_S = 0.0005
    # Below 100 columns the screen is -narrow, and the KV panel takes less of the width there.
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (100, "-wide")]

    def __init__(self, settings: Settings, *, engine: Backend | None = None, store: ChatStore | None = None,
                 flags: frozenset[str] = frozenset()):
        """engine / store: already running ones to use (and leave running), e.g. shared by tests;
        by default the app builds its own from settings and shuts them down when it exits. flags:
        the settings the command line set, which its warnings name as flags rather than config.toml."""
        super().__init__()
        self.settings = settings
        self.flags = flags
        self.services = ChatServices(settings, engine, store)
        self.keymap = dict(settings.keys)
        self.ready = False  # engine and store are up, chats can run
        self.note = GIBBERISH_NOTE if settings.uses_demo_model else None
        # Held rather than queried: the pump reads the active chat on every tick, and the exit
        # reads the chats after the DOM is gone.
        self._tabs = ChatTabs(background=self.in_background, new_conversation=self.new_conversation,
                              keymap=self.keymap, note=self.note, id="chats")
        self.pump: StreamPump | None = None  # from on_mount: its timer needs the running app
        self.tool_rounds = ToolRounds(self, settings.mcp_servers)
        self._loading: LoadingScreen | None = None
        self._theme_applied = False
        self._stop_quitting_on_signals = None
        self._last_shown: ChatPane | None = None  # the chat whose tab was shown last

    # --- composition ---------------------------------------------------------------------------------

    def get_default_screen(self) -> ChatScreen:
        return ChatScreen(id="_default")

    def compose(self) -> ComposeResult:
        yield Header(icon="≡")
        with Horizontal(id="main"):
            yield self._tabs
            yield KVPanel(id="kv-panel")
        yield ChatFooter()

    def on_mount(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(self.GIL_SWITCH_INTERVAL_S)
        for theme in load_themes():
            self.register_theme(theme)
        if self.settings.theme in self.available_themes:
            self.theme = self.settings.theme
        else:
            source = "--theme" if "theme" in self.flags else "config.toml"
            self.notify(f"{source}: unknown theme {self.settings.theme!r}; using {FALLBACK_THEME} (the palette, "
                        f"Ctrl+P, lists the themes)", severity="warning", timeout=10)
            self.theme = FALLBACK_THEME
        self._theme_applied = True
        unknown = unknown_key_ids(self.keymap)
        if unknown:
            self.notify(f"config.toml [keys]: no binding has the id(s) {', '.join(unknown)} (F1 lists them)",
                        severity="warning", timeout=10)
        self.set_keymap(self.keymap)
        self.set_class(self.settings.compact_transcript, "-compact")
        self.sub_title = self.note or model_label(self.settings)
        self.pump = StreamPump(self, self.tabs, self.PUMP_HZ, self.MIN_DRAW_HZ, self.UI_CPU_BUDGET_ONE,
                               self.UI_CPU_BUDGET_MANY)
        self._stop_quitting_on_signals = quit_on_signals(self.exit)
        self.query_one(KVPanel).source = lambda: self.tabs.panel_data(self.engine.stats())
        if self.engine is None:
            self._loading = LoadingScreen(model_label(self.settings), self.note)
            self.push_screen(self._loading)
        self.services.start(self.call_from_thread, progress=self._start_stage, ready=self._started,
                            failed=self._start_failed)

    @property
    def engine(self) -> Backend | None:
        return self.services.engine

    @property
    def store(self) -> ChatStore | None:
        return self.services.store

    @property
    def tabs(self) -> ChatTabs:
        return self._tabs

    @property
    def active_pane(self) -> ChatPane | None:
        return self.tabs.active_chat

    def in_background(self, fn, *args) -> asyncio.Future:
        """Runs fn on the conversation thread (ChatServices.in_background)."""
        return self.services.in_background(fn, *args)

    def new_conversation(self) -> Conversation:
        conversation = Conversation(self.engine, self.store, system_prompt=self.settings.system_prompt,
                                    model_name=model_name(self.settings, self.engine), settings=self.settings)
        conversation.toolbox = self.tool_rounds.tools
        return conversation

    # --- start-up ------------------------------------------------------------------------------------

    def _start_stage(self, stage: str) -> None:
        if self._loading is not None:
            self._loading.add_stage(stage)

    async def _started(self) -> None:
        typed = self._loading.typed if self._loading is not None else ""
        if self._loading is not None and self.screen is self._loading:
            self.pop_screen()
        self._loading = None
        self.tool_rounds.start()
        if self.store.moved_aside is not None:
            self.notify(f"It was moved to {self.store.moved_aside}; new conversations go to a fresh file.",
                        title="The conversation store could not be read", severity="error", timeout=30)
        self.sub_title = self.note or model_label(self.settings, self.engine)
        if self.engine.capabilities.one_request_at_a_time:
            self.notify(ONE_AT_A_TIME_NOTE, title=model_label(self.settings, self.engine), timeout=15)
        pane = await self._reopen_tabs() or await self.tabs.open(self.new_conversation())
        if typed:
            pane.prompt.insert(typed)
        self.ready = True
        self.refresh_bindings()
        self.save_open_tabs()
        startup_trace.mark("ready")

    async def _reopen_tabs(self) -> ChatPane | None:
        """The chats that were open when the app last closed, in order; returns the one that had the
        focus, shown (None when there were none to reopen)."""
        # A store moved aside starts afresh: the ids saved with the old one name nothing in it.
        if not self.settings.restore_tabs or self.store.moved_aside is not None:
            return None
        try:
            saved = await self.in_background(load_open_tabs, tabs_file(self.store.path))
        except (ValueError, OSError) as e:
            self.notify(str(e), title="The open chats could not be reopened", severity="warning", timeout=10)
            return None
        if saved is None:
            return None
        panes: list[ChatPane | None] = []
        missing = 0
        for conversation_id in saved.conversation_ids:
            if conversation_id is None:
                conversation = self.new_conversation()
            else:
                try:
                    conversation = await self.in_background(Conversation.load, self.engine, self.store,
                                                            conversation_id, self.settings)
                except KeyError:  # deleted since, e.g. by another nvchat on this data directory
                    missing += 1
                    panes.append(None)
                    continue
                conversation.toolbox = self.tool_rounds.tools
            panes.append(await self.tabs.open(conversation, show=False))
        if missing:
            self.notify(f"{missing} of the chats that were open no longer exist{'s' if missing == 1 else ''}.",
                        severity="warning")
        opened = [pane for pane in panes if pane is not None]
        if not opened:
            return None
        focused = panes[saved.focused] if saved.focused < len(panes) else None
        focused = focused or opened[-1]
        self.tabs.show(focused)
        return focused

    def _open_tabs(self) -> tuple[list[Conversation], int]:
        panes = self.tabs.panes
        # At exit the tabs may already be going; the last one shown is the one that had the focus.
        active = self.active_pane or self._last_shown
        return [pane.conversation for pane in panes], panes.index(active) if active in panes else 0

    def save_open_tabs(self) -> None:
        """Records the open chats and the focused one, on the conversation thread: after the writes
        queued before it, which give a chat's first message or draft its id."""
        if not self.ready or not self.settings.restore_tabs or self.services.closing:
            return
        conversations, focused = self._open_tabs()
        self.in_background(_write_open_tabs, tabs_file(self.store.path), conversations, focused)

    def _start_failed(self, detail: str) -> None:
        if self._loading is not None:
            self._loading.fail(detail)
        self.notify(detail, title="The engine could not start", severity="error", timeout=30)

    # --- what the parts tell the app -----------------------------------------------------------------

    def on_chat_pane_reply_started(self, event: ChatPane.ReplyStarted) -> None:
        self.pump.start(event.pane)

    def on_chat_pane_tool_calls_made(self, event: ChatPane.ToolCallsMade) -> None:
        self.run_worker(self._run_tool_calls(event.pane, event.message))

    async def _run_tool_calls(self, pane: ChatPane, message) -> None:
        try:
            await self.tool_rounds.run(pane, message)
        except Exception as e:  # the chat must not stay busy for good
            self.notify(f"{type(e).__name__}: {e}", title="The tool calls could not be run", severity="error")
            pane.end_tool_round()

    def on_chat_pane_state_changed(self, event: ChatPane.StateChanged) -> None:
        self.pump.defer_full_collections()
        if not self.screen_stack:
            return  # a reply that ended as the app closed: no screen is left to redraw
        # The footer's keys depend on the active chat alone.
        if event.pane is self.active_pane:
            self.refresh_bindings()
        self.save_open_tabs()  # a first message stores the chat, a busy one may have been closed

    async def on_tabbed_content_tab_activated(self) -> None:
        if not self.screen_stack:
            return
        self.refresh_bindings()
        await self.tabs.tab_shown()
        self._last_shown = self.active_pane or self._last_shown
        self.save_open_tabs()

    async def on_slash_command_submitted(self, event: SlashCommandSubmitted) -> None:
        await self.run_slash_command(event.name, event.arg)

    def watch_theme(self, theme: str) -> None:
        if not self._theme_applied:
            return
        self.tabs.recolor()
        if theme != self.settings.theme:
            self.settings.theme = theme
            self.run_worker(self.save_setting("theme", theme))

    # --- exit ----------------------------------------------------------------------------------------

    async def on_unmount(self) -> None:
        self._stop_quitting_on_signals()
        sys.setswitchinterval(self._switch_interval)
        self.pump.stop()
        panes = self.tabs.panes
        live = [(pane.conversation, pane.take_streams()) for pane in panes]
        drafts = [(pane.conversation, pane.draft) for pane in panes]
        then = None
        if self.ready and self.settings.restore_tabs:
            conversations, focused = self._open_tabs()
            path = tabs_file(self.store.path)
            then = partial(_write_open_tabs, path, conversations, focused)
        for pane in panes:
            pane.stop_draft_timer()
        await self.services.close(live, drafts, then)
        await self.tool_rounds.close()


def _write_open_tabs(path: Path, conversations: list[Conversation], focused: int) -> None:
    """On the conversation thread, where the conversations' ids are assigned."""
    try:
        save_open_tabs(path, OpenTabs([c.id for c in conversations], focused))
    except OSError:  # only a convenience for the next start; the chats themselves are stored
        pass
