"""The nvchat Textual app: chats as tabs over one in-process EngineThread.

Threads, and what runs where:
- the UI thread (Textual's event loop) only moves text into widgets;
- the engine thread steps the model and appends tokens to each RequestStream;
- one conversation thread runs everything that tokenizes or touches SQLite, in order;
- a start-up thread worker builds the engine, reporting each stage to the loading screen.

Streaming: one app-level timer (PUMP_HZ) drains every active stream with RequestStream.drain(),
which hands over everything since the last draw as one delta. The visible chat appends it to its
reply's MarkdownStream, so it gets at most PUMP_HZ updates a second however fast tokens arrive,
and fewer while drawing is costly (DrawPacer); a chat in a hidden tab only accumulates it, and
draws it when its tab is shown. The engine never posts per-token messages. The UI thread's time
is the engine's too: the engine thread needs the GIL between its GPU waits, so whatever the UI
draws that nobody sees slows generation. Hence also ChatScreen, whose compositor renders only
what an update shows, and the full garbage collections held back while chats stream.
"""
from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from textual.app import App, ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Header, TabbedContent, TabPane, Tabs

from engine import RequestStream
from engine.backend import Backend
from nvchat import paths
from nvchat.app.bindings import APP_KEYS, bindings, unknown_key_ids
from nvchat.app.chat_pane import ChatPane
from nvchat.app.chat_screen import ChatScreen
from nvchat.app.code_block import CopyableFence, copy_code
from nvchat.app.commands import ChatCommands
from nvchat.app.conversations_screen import ConversationsScreen
from nvchat.app.footer import ChatFooter
from nvchat.app.frame_stats import FrameStats
from nvchat.app.help_screen import HelpScreen
from nvchat.app.kv_panel import BlockOwner, KVPanel, PanelData
from nvchat.app.loading_screen import LoadingScreen
from nvchat.app.messages import ChatStateChanged, ReplyStarted, SlashCommandSubmitted
from nvchat.app.pacing import DrawPacer, FullCollectionDeferral
from nvchat.app.rename_screen import RenameScreen
from nvchat.app.sampling_screen import SamplingScreen
from nvchat.app.slash import run_command
from nvchat.app.system_prompt_screen import SystemPromptScreen
from nvchat.backend import model_name, open_backend
from nvchat.conversation import Conversation
from nvchat.default_model import GIBBERISH_NOTE
from nvchat.export import export_markdown, save_markdown_to
from nvchat.settings import DEFAULT_SYSTEM_PROMPT, Settings, save_setting
from nvchat.store import ChatStore
from themes import load_themes, tab_colors

FALLBACK_THEME = "nvchat-dark"
# Actions that need a started engine and the chat screen on top.
_CHAT_ACTIONS = {spec.action for spec in APP_KEYS} - {"help", "quit", "toggle_kv_panel"} | {"default_system_prompt",
                                                                                        "copy_code"}


_BOUND_ACTIONS = {spec.action for spec in APP_KEYS}


def model_label(settings: Settings) -> str:
    if settings.uses_demo_model:
        return "demo model"
    return Path(settings.model_name).name or settings.model_name


def _store_partial_reply(conversation: Conversation, stream: RequestStream) -> None:
    stream.wait(5)
    conversation.finish_reply(stream)


class NvchatApp(App[None]):
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

    def __init__(self, settings: Settings, *, engine: Backend | None = None, store: ChatStore | None = None):
        """engine / store: already running ones to use (and leave running), e.g. shared by tests;
        by default the app builds its own from settings and shuts them down when it exits."""
        super().__init__()
        self.settings = settings
        self.engine = engine
        self.store = store
        self._owns_engine = engine is None
        self._owns_store = store is None
        self.keymap = dict(settings.keys)
        self.ready = False  # engine and store are up, chats can run
        self.closing = False
        self.note = GIBBERISH_NOTE if settings.uses_demo_model else None
        self.frame_stats = FrameStats()
        self.draw_pacer = DrawPacer(self.PUMP_HZ, self.MIN_DRAW_HZ, self.UI_CPU_BUDGET_ONE, self.UI_CPU_BUDGET_MANY)
        self._gc_deferral = FullCollectionDeferral()
        self._conversation_thread = ThreadPoolExecutor(1, thread_name_prefix="nvchat-conversations")
        self._panes: list[ChatPane] = []
        self._streaming: dict[ChatPane, None] = {}  # panes the pump drains, in start order
        self._request_owners: dict[int, ChatPane] = {}  # request id -> chat, for the KV panel
        self._tab_serial = 0
        self._loading: LoadingScreen | None = None
        self._theme_applied = False
        self._signals_handled: list[int] = []

    # --- start-up ------------------------------------------------------------------------------------

    def get_default_screen(self) -> ChatScreen:
        return ChatScreen(id="_default")

    def compose(self) -> ComposeResult:
        yield Header(icon="≡")
        with Horizontal(id="main"):
            yield TabbedContent(id="chats")
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
            self.notify(f"config.toml: unknown theme {self.settings.theme!r}; using {FALLBACK_THEME}",
                        severity="warning")
            self.theme = FALLBACK_THEME
        self._theme_applied = True
        unknown = unknown_key_ids(self.keymap)
        if unknown:
            self.notify(f"config.toml [keys]: no binding has the id(s) {', '.join(unknown)} (F1 lists them)",
                        severity="warning", timeout=10)
        self.set_keymap(self.keymap)
        self.sub_title = self.note or model_label(self.settings)
        self._pump_timer = self.set_interval(1 / self.PUMP_HZ, self._pump_replies, pause=True)
        self._quit_on_signals()
        self.query_one(KVPanel).source = self._panel_data
        # Tab from the prompt box goes to the transcript and its code blocks, which hand typing back
        # to the box (ChatPane.on_key), never to the tab bar, where it was lost (its keys have
        # bindings of their own: Ctrl+PgDn/PgUp, Alt+arrows).
        self.tabs.query_one(Tabs).can_focus = False
        if self.engine is None:
            self._loading = LoadingScreen(model_label(self.settings), self.note)
            self.push_screen(self._loading)
        self._start_backend()

    # Asked to end (a shutdown, a closed terminal): quit as Ctrl+Q does, so replies in flight are
    # stored as far as they got, rather than die with only their last periodic save.
    _QUIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP) if hasattr(signal, "SIGHUP") else (signal.SIGTERM,)

    def _quit_on_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for number in self._QUIT_SIGNALS:
            try:
                loop.add_signal_handler(number, self.exit)
            except (NotImplementedError, RuntimeError, ValueError):  # no such handlers here (Windows, a thread)
                continue
            self._signals_handled.append(number)

    def _to_ui(self, callback, *args) -> None:
        """call_from_thread, skipped once the app is closing (its loop may never run the call)."""
        if self.closing:
            return
        try:
            self.call_from_thread(callback, *args)
        except RuntimeError:
            pass

    def _start_backend(self) -> None:
        # A daemon thread, not a Textual thread worker: quitting during a long model load must not
        # wait for the load (Textual joins its workers' executor on exit).
        threading.Thread(target=self._build_backend, name="nvchat-start", daemon=True).start()

    def _build_backend(self) -> None:
        loading = self._loading

        def progress(stage: str) -> None:
            if loading is not None:
                self._to_ui(loading.add_stage, stage)

        engine, store = self.engine, self.store
        try:
            if engine is None:
                if self.settings.uses_demo_model:
                    progress("preparing the demo model")
                engine = open_backend(self.settings, progress)
                progress("connecting to the server" if self.settings.backend else "starting the engine thread")
                engine.start()
            if store is None:
                progress("opening the conversation store")
                store = ChatStore()
        except Exception as e:  # shown on the loading screen rather than as a traceback
            detail = str(e) if isinstance(e, (ValueError, OSError, RuntimeError)) else f"{type(e).__name__}: {e}"
            if engine is not None and self._owns_engine:
                engine.shutdown()
            self._to_ui(self._backend_failed, detail or type(e).__name__)
            return
        if self.closing:
            self._close_backend(engine, store, [])
            return
        self._to_ui(self._backend_ready, engine, store)

    async def _backend_ready(self, engine: Backend, store: ChatStore) -> None:
        self.engine, self.store = engine, store
        typed = self._loading.typed if self._loading is not None else ""
        if self._loading is not None and self.screen is self._loading:
            self.pop_screen()
        self._loading = None
        if store.moved_aside is not None:
            self.notify(f"It was moved to {store.moved_aside}; new conversations go to a fresh file.",
                        title="The conversation store could not be read", severity="error", timeout=30)
        pane = await self.open_chat(self.new_conversation())
        if typed:
            pane.prompt.insert(typed)
        self.ready = True
        self.refresh_bindings()

    def _backend_failed(self, detail: str) -> None:
        if self._loading is not None:
            self._loading.fail(detail)
        self.notify(detail, title="The engine could not start", severity="error", timeout=30)

    # --- chats -------------------------------------------------------------------------------------

    def in_background(self, fn, *args) -> asyncio.Future:
        """Runs fn on the conversation thread. Shielded: a caller that goes away (a closed tab, app
        exit) does not cancel a write that was already queued."""
        return asyncio.shield(asyncio.wrap_future(self._conversation_thread.submit(fn, *args)))

    def new_conversation(self) -> Conversation:
        return Conversation(self.engine, self.store, system_prompt=self.settings.system_prompt,
                            model_name=model_name(self.settings, self.engine), settings=self.settings)

    @property
    def tabs(self) -> TabbedContent:
        return self.query_one("#chats", TabbedContent)

    @property
    def active_pane(self) -> ChatPane | None:
        # Read by every pump tick: the chats' own list rather than two DOM queries.
        active = self.tabs.active
        return next((pane for pane in self._panes if pane.parent is not None and pane.parent.id == active), None)

    def _color_for(self, slot: int) -> str:
        colors = tab_colors(self.current_theme)
        return colors[slot % len(colors)]

    def _tab_label(self, pane: ChatPane) -> Content:
        # Not "…", which a title cut short already ends with ("a… …").
        marker = (" ▸", pane.color) if pane.busy else ""
        return Content.assemble(("● ", pane.color), pane.conversation.title, marker)

    async def open_chat(self, conversation: Conversation) -> ChatPane:
        self._tab_serial += 1
        slot = self._tab_serial - 1
        pane = ChatPane(conversation, background=self.in_background, color=self._color_for(slot), color_slot=slot,
                        note=self.note)
        tab = TabPane(self._tab_label(pane), pane, id=f"chat-{self._tab_serial}")
        self._panes.append(pane)
        await self.tabs.add_pane(tab)
        self.tabs.active = tab.id
        pane.prompt.focus()
        return pane

    async def close_chat(self, pane: ChatPane) -> None:
        stream = pane.stream
        if stream is not None:
            # Its tab is going: stop the reply here and keep what it said so far.
            pane.stream = None
            stream.abort()
            self.in_background(_store_partial_reply, pane.conversation, stream)
        self._streaming.pop(pane, None)
        self._panes.remove(pane)
        self._defer_full_collections()
        self._request_owners = {rid: p for rid, p in self._request_owners.items() if p is not pane}
        pane.save_draft()  # queued before the tab goes, and kept if the app quits meanwhile
        tab_pane = pane.parent
        await self.tabs.remove_pane(tab_pane.id)
        if not self._panes:
            await self.open_chat(self.new_conversation())
        elif self.active_pane is not None:
            self.active_pane.prompt.focus()

    def on_reply_started(self, event: ReplyStarted) -> None:
        stream = event.pane.stream
        if stream is None:
            return
        self._request_owners[stream.request_id] = event.pane
        self._streaming[event.pane] = None
        self._pump_timer.resume()

    async def on_tabbed_content_tab_activated(self) -> None:
        if not self.screen_stack:
            return
        self.refresh_bindings()
        for pane in self._panes:  # a chat left: what it had typed is stored now, not later
            pane.flush_draft()
        pane = self.active_pane
        if pane is not None:
            await pane.catch_up()

    async def on_slash_command_submitted(self, event: SlashCommandSubmitted) -> None:
        await run_command(self, event.name, event.arg)

    def on_chat_state_changed(self, event: ChatStateChanged) -> None:
        self._defer_full_collections()
        if not self.screen_stack:
            return  # a reply that ended as the app closed: no screen is left to redraw
        pane = event.pane
        # The footer's keys depend on the active chat alone.
        if pane is self.active_pane:
            self.refresh_bindings()
        if pane.parent is not None and pane.parent.id:
            try:
                self.tabs.get_tab(pane.parent.id).label = self._tab_label(pane)
            except Exception:  # the tab closed in the meantime
                pass

    async def _pump_replies(self) -> None:
        started = time.perf_counter()
        shown = self.active_pane
        draw = self.draw_pacer.due(started)
        drawing, streams = draw and shown in self._streaming, len(self._streaming)
        if not draw and shown in self._streaming:
            # Hidden chats only accumulate: draining them can wait for the visible one's next draw.
            self.frame_stats.record(started, time.perf_counter())
            return
        for pane in list(self._streaming):
            try:
                ended = await pane.pump(pane is shown, draw)
            except Exception as e:  # one broken pane must not stall the others
                self.log.error(f"pump failed for {pane}: {e!r}")
                ended = True
            if ended:
                self._streaming.pop(pane, None)
        now = time.perf_counter()
        self.frame_stats.record(started, now, drew=drawing)
        if drawing:
            self.draw_pacer.drew(now, streams)
        if self._streaming:
            self._gc_deferral.tick()
        else:
            self._pump_timer.pause()
            self.frame_stats.pause()
            self.draw_pacer.reset()
            self._defer_full_collections()

    def _defer_full_collections(self) -> None:
        """From the start of a turn, not of its stream: starting a turn builds the most (its views,
        and in the benchmark 8 tabs' at once), which is when a full collection fell due, a stall
        of 0.2 s before the first token."""
        if self._streaming or any(pane.busy for pane in self._panes):
            self._gc_deferral.start()
        else:
            self._gc_deferral.stop()

    # --- KV panel ----------------------------------------------------------------------------------

    def _panel_data(self) -> PanelData:
        snapshot = self.engine.stats()  # None from a remote backend
        # A finished request's owner is kept until the engine's snapshot no longer shows it holding
        # blocks (the snapshot trails the streams by a step).
        live = {p.stream.request_id for p in self._panes if p.stream is not None}
        self._request_owners = {rid: p for rid, p in self._request_owners.items()
                                if rid in live or (snapshot is not None and rid in snapshot.block_holders)}
        owners = {rid: BlockOwner(p.conversation.title, p.color) for rid, p in self._request_owners.items()}
        chats = [BlockOwner(p.conversation.title, p.color) for p in self._panes]
        return PanelData(snapshot, owners, chats)

    # --- actions -------------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # The app's bindings are priority bindings: stand aside while a modal (a dialog, the
        # command palette, help) is up, so that it gets its own keys (Esc, F1, Ctrl+S...).
        # Textual's own app actions (focus_next for Tab, the palette's) stay on: a dialog needs them.
        if isinstance(self.screen, ModalScreen) and action in _BOUND_ACTIONS and action != "quit":
            return False
        if action in _CHAT_ACTIONS | {"toggle_kv_panel"} and not self.ready:
            return False
        # None: shown greyed out in the footer, and the key goes to the focused widget instead.
        if action in ("stop_reply", "regenerate", "edit_last"):
            pane = self.active_pane
            if pane is None:
                return None
            if action == "stop_reply":
                return True if pane.busy or pane.editing else None
            return None if pane.busy or not pane.conversation.messages else True
        return True

    async def action_new_tab(self) -> None:
        await self.open_chat(self.new_conversation())

    async def action_close_tab(self) -> None:
        if self.active_pane is not None:
            await self.close_chat(self.active_pane)

    def _cycle_tab(self, step: int) -> None:
        ids = [tab.id for tab in self.tabs.query(TabPane)]
        if len(ids) > 1 and self.tabs.active in ids:
            self.tabs.active = ids[(ids.index(self.tabs.active) + step) % len(ids)]
            self.active_pane.prompt.focus()

    def action_next_tab(self) -> None:
        self._cycle_tab(1)

    def action_previous_tab(self) -> None:
        self._cycle_tab(-1)

    def action_rename_tab(self) -> None:
        pane = self.active_pane
        if pane is None:
            return

        def renamed(title: str | None) -> None:
            if title:
                self.run_worker(pane.rename(title))

        self.push_screen(RenameScreen(pane.conversation.title), renamed)

    def action_stop_reply(self) -> None:
        if self.active_pane is not None:
            self.active_pane.stop()

    def action_regenerate(self) -> None:
        if self.active_pane is not None:
            self.active_pane.regenerate()

    def action_edit_last(self) -> None:
        if self.active_pane is not None:
            self.active_pane.start_edit()

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

    def action_default_system_prompt(self) -> None:
        def edited(text: str | None) -> None:
            if text is not None:
                self.settings.system_prompt = text
                self.run_worker(self._save_setting("system_prompt", text, "New chats will use this system prompt."))

        self.push_screen(SystemPromptScreen("Default system prompt for new chats", self.settings.system_prompt,
                                            DEFAULT_SYSTEM_PROMPT), edited)

    def action_toggle_kv_panel(self) -> None:
        panel = self.query_one(KVPanel)
        panel.set_shown(not panel.display)

    def action_open_conversations(self) -> None:
        def chosen(conversation_id: int | None) -> None:
            if conversation_id is None:
                return
            for pane in self._panes:
                if pane.conversation.id == conversation_id:
                    self.tabs.active = pane.parent.id
                    pane.prompt.focus()
                    return
            self.run_worker(self._reopen(conversation_id))

        self.push_screen(ConversationsScreen(lambda text: self.in_background(self.store.search_conversations, text)),
                         chosen)

    async def _reopen(self, conversation_id: int) -> None:
        try:
            conversation = await self.in_background(Conversation.load, self.engine, self.store, conversation_id,
                                                    self.settings)
        except Exception as e:
            self.notify(str(e), title="Could not open the conversation", severity="error")
            return
        await self.open_chat(conversation)

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
                path = await self.in_background(export_markdown, conversation, [Path.cwd(), paths.exports_dir()])
            else:
                path = await self.in_background(save_markdown_to, conversation, path)
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

    async def action_quit(self) -> None:
        if self._loading is not None and self._loading.error:
            self._loading.action_leave()  # as q there: the exit status and message say the start failed
        else:
            await super().action_quit()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.keymap))

    # --- settings that persist -----------------------------------------------------------------------

    def watch_theme(self, theme: str) -> None:
        if not self._theme_applied:
            return
        for pane in self._panes:
            pane.color = self._color_for(pane.color_slot)
            self.post_message(ChatStateChanged(pane))
        if theme != self.settings.theme:
            self.settings.theme = theme
            self.run_worker(self._save_setting("theme", theme))

    async def _save_setting(self, name: str, value, done: str | None = None) -> None:
        try:
            await self.in_background(save_setting, name, value)
        except (ValueError, OSError) as e:  # SettingsError, and a config.toml edited into invalid TOML
            self.notify(str(e), title="Could not save the setting", severity="error")
            return
        if done:
            self.notify(done)

    # --- exit ----------------------------------------------------------------------------------------

    async def on_unmount(self) -> None:
        self.closing = True
        loop = asyncio.get_running_loop()
        for number in self._signals_handled:
            loop.remove_signal_handler(number)
        sys.setswitchinterval(self._switch_interval)
        self._gc_deferral.stop()
        live = [(pane.conversation, pane.stream) for pane in self._panes if pane.stream is not None]
        drafts = [(pane.conversation, pane.draft) for pane in self._panes]
        for pane in self._panes:
            pane.stream = None
            pane.stop_draft_timer()
        await asyncio.to_thread(self._close_backend, self.engine, self.store, live, drafts)

    def _close_backend(self, engine: Backend | None, store: ChatStore | None,
                       live: list[tuple[Conversation, RequestStream]],
                       drafts: list[tuple[Conversation, str]] = ()) -> None:
        """Stops replies still running (keeping their text), stores what each chat had typed and not
        sent, lets queued writes finish, then shuts down what the app started. Runs off the UI thread."""
        for _, stream in live:
            stream.abort()
        for conversation, stream in live:
            self._conversation_thread.submit(_store_partial_reply, conversation, stream)
        for conversation, text in drafts:
            self._conversation_thread.submit(conversation.save_draft, text)
        self._conversation_thread.shutdown(wait=True)
        if engine is not None and self._owns_engine:
            engine.shutdown()
        if store is not None and self._owns_store:
            store.close()
