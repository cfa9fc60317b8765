"""`nvchat --plain`: a prompt-toolkit REPL that streams replies as plain text.

While a reply streams, the REPL keeps reading the terminal through prompt-toolkit's Input (raw
mode, so Ctrl-C arrives as a key, not a signal): Ctrl-C aborts the reply, and anything else typed
is kept as typeahead for the next prompt. That also makes Ctrl-C deliverable from a pipe input.
"""
import asyncio
import inspect
import signal
import sqlite3
import sys
import threading
from contextlib import contextmanager
from typing import TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.history import FileHistory, History
from prompt_toolkit.input.typeahead import get_typeahead, store_typeahead
from prompt_toolkit.key_binding import KeyBindings, KeyPress
from prompt_toolkit.keys import Keys

from engine import RequestStream
from engine.backend import Backend
from nvchat import paths, repl_slash_handlers, slash_table, startup_trace
from nvchat.backend import model_name, open_backend
from nvchat.conversation import SAVE_EVERY_S, Conversation, Message, first_line
from nvchat.default_model import GIBBERISH_NOTE
from nvchat.repl_tools import ReplTools
from nvchat.settings import Settings
from nvchat.store import ChatStore

PROMPT = "> "
CONTINUATION = ". "
_INTERRUPT_KEYS = (Keys.ControlC, Keys.SIGINT)


def _key_bindings(on_clear) -> KeyBindings:
    """on_clear: called when Ctrl-C empties the line (an edit or an added file is given up)."""
    kb = KeyBindings()

    @kb.add("enter")
    def _send(event):
        event.current_buffer.validate_and_handle()

    @kb.add("escape", "enter")
    @kb.add("c-j")
    def _newline(event):
        event.current_buffer.insert_text("\n")

    @kb.add("c-c")
    @kb.add("<sigint>")
    def _interrupt(event):
        buffer = event.current_buffer
        if buffer.text:
            buffer.reset()
            on_clear()
        else:
            event.app.exit(exception=KeyboardInterrupt())

    return kb


class Repl:
    def __init__(self, engine: Backend, settings: Settings, *, store: ChatStore | None,
                 out: TextIO | None = None, history: History | None = None, input=None, output=None,
                 model_name: str | None = None, note: str | None = None):
        """out: where replies and messages go (default stdout); input/output: prompt-toolkit's
        (default: the current app session's); note: a line for the banner."""
        self.engine = engine
        self.settings = settings
        self.store = store
        self.out = out or sys.stdout
        self.model_name = model_name or settings.model_name
        self.note = note
        self.last_stream: RequestStream | None = None
        self._streaming: list[RequestStream] = []  # the reply shown as it streams, then its alternatives
        self.conversation: Conversation | None = None
        # What the next prompt starts with (/edit's message, /file's blocks), and the message that
        # line replaces when sent (/edit): both given up when Ctrl-C clears the line.
        self.next_line = ""
        self.editing: int | None = None
        self.alternatives: list[Message | None] = []  # the last /alt's replies, for /pick
        # config.toml's MCP servers, started with the loop (run_async)
        self.tools = ReplTools(settings.mcp_servers, input=input, output=output) if settings.mcp_servers else None
        self.new_conversation()
        self.session = PromptSession(PROMPT, multiline=True, prompt_continuation=CONTINUATION,
                                     key_bindings=_key_bindings(self._line_cleared), history=history,
                                     input=input, output=output)

    def new_conversation(self) -> Conversation:
        if self.conversation is not None:
            self.conversation.release()  # another process may write it now
        self.conversation = Conversation(self.engine, self.store, system_prompt=self.settings.system_prompt,
                                         model_name=self.model_name, settings=self.settings)
        self.conversation.toolbox = self.tools.tools if self.tools is not None else None
        self._line_cleared()
        self.alternatives = []
        return self.conversation

    @property
    def streaming(self) -> RequestStream | None:
        """The reply being shown as it streams, if one is."""
        return self._streaming[0] if self._streaming else None

    def _line_cleared(self) -> None:
        self.next_line = ""
        self.editing = None

    def _print(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()

    # --- the loop ------------------------------------------------------------------------------------

    def run(self) -> int:
        """Runs until /quit, Ctrl-D, or a second Ctrl-C at an empty prompt; returns the exit code."""
        try:
            return asyncio.run(self.run_async())
        except KeyboardInterrupt:
            self._abort_replies()
            return 130

    def _abort_replies(self) -> None:
        for stream in self._streaming:
            stream.abort()

    async def run_async(self) -> int:
        if self.tools is not None:
            self.conversation.toolbox = self.tools.start()
        self._print(f"nvchat plain mode · model: {self.model_name}")
        if self.note:
            self._print(f"[{self.note}]")
        self._print("Enter sends · Meta+Enter or Ctrl-J: new line · Ctrl-C stops a reply · /help lists commands")
        try:
            return await self._loop()
        finally:
            if self.tools is not None:
                await asyncio.to_thread(self.tools.close)

    async def _loop(self) -> int:
        quit_armed = False
        with self._sigint_as_key():
            while True:
                for report in self.tools.take_reports() if self.tools is not None else ():
                    self._print(report)
                try:
                    line = await self.session.prompt_async(handle_sigint=False, default=self.next_line)
                except KeyboardInterrupt:
                    if quit_armed:
                        break
                    quit_armed = True
                    self._print("(press Ctrl-C again to quit, or type /quit)")
                    continue
                except EOFError:
                    break
                quit_armed = False
                self.next_line = ""
                text = line.strip()
                if not text:
                    continue
                invocation = slash_table.parse(text, slash_table.REPL)
                if invocation is not None:
                    if self.editing is not None and invocation.name != "edit":
                        self.editing = None
                        self._print("[the edit is given up]")
                    try:
                        message = repl_slash_handlers.dispatch(self, invocation)
                        if inspect.isawaitable(message):  # a command that streams a reply
                            message = await message
                    except repl_slash_handlers.QuitRepl:
                        break
                    except (OSError, ValueError, sqlite3.Error) as e:  # /save to a bad path, a locked store
                        message = f"error: {e}"
                    if message:
                        self._print(message)
                elif self.editing is not None:
                    index, self.editing = self.editing, None
                    await self.edit(index, slash_table.message_text(text))
                else:
                    await self.ask(slash_table.message_text(text))
        return 0

    @contextmanager
    def _sigint_as_key(self):
        """A SIGINT from outside (kill -INT, or Ctrl-C while the terminal is briefly in cooked mode
        between prompts) acts like the Ctrl-C key instead of killing the REPL mid-write."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, self._on_sigint)
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    def _on_sigint(self) -> None:
        if self.streaming is not None:
            self._abort_replies()
        elif self.session.app.is_running:
            self.session.app.key_processor.send_sigint()
        else:  # between prompts: the next prompt takes it as its first key
            store_typeahead(self.session.input, [KeyPress(Keys.ControlC, "\x03")])

    # --- one turn --------------------------------------------------------------------------------------

    async def ask(self, text: str) -> RequestStream | None:
        """Sends a message and streams the reply to `out`; the finished reply is stored."""
        conversation = self.conversation
        if not conversation.messages and conversation.title == "New chat":  # not after a /rename
            conversation.title = first_line(text, 60) or "New chat"
        return await self._turn(lambda: conversation.send(text))

    async def edit(self, index: int, text: str) -> RequestStream | None:
        """Sends text in place of the user message at messages[index], as a new branch beside it."""
        stream = await self._turn(lambda: self.conversation.edit(index, text))
        if stream is not None:
            self._print(self._branch_note(index, "your message"))
        return stream

    async def regenerate(self) -> RequestStream | None:
        """A new reply beside the last one (kept as a branch)."""
        stream = await self._turn(self.conversation.regenerate)
        if stream is not None:
            self._print(self._branch_note(len(self.conversation.messages) - 1, "the reply"))
        return stream

    def _branch_note(self, index: int, what: str) -> str:
        which, count = self.conversation.branch_position(self.conversation.messages[index])
        return f"[{what} is branch {which}/{count}; /branch prev shows the one before]"

    async def _turn(self, start) -> RequestStream | None:
        """start(): the conversation's call that stores the message and starts the reply. A reply
        that calls tools goes on once they have run (as many rounds as the conversation allows)."""
        first = None
        while True:
            try:
                stream = start()
            except (ValueError, RuntimeError, sqlite3.Error) as e:
                self._print(f"error: {e}")
                return first
            first = first or stream
            self.alternatives = []
            self.last_stream = stream
            await self._stream_replies([stream])
            self._finish(stream, show=True)
            self._end_reply(stream)
            if not await self._run_tool_calls():
                return first
            start = self.conversation.continue_after_tools

    async def _run_tool_calls(self) -> bool:
        """True when the last reply's tool calls have all run (or been refused) and it may go on."""
        if self.tools is None or not self.conversation.pending_tool_calls:
            return False
        try:
            return await self.tools.run_calls(self.conversation, self._print)
        except sqlite3.Error as e:
            self._print(f"error: the tool's result could not be stored ({e}); the turn ends here")
            return False

    async def alternatives_beside_last_reply(self, count: int) -> list[RequestStream]:
        """count replies at once in place of the last one; the first streams, the others are printed
        as they are when all have ended. Each is stored; /pick N keeps another as the one shown."""
        try:
            streams = self.conversation.regenerate(alternatives=count)
        except (ValueError, RuntimeError, sqlite3.Error) as e:
            self._print(f"error: {e}")
            return []
        self.last_stream = streams[0]
        self._print(f"[alternative 1 of {count}]")
        await self._stream_replies(streams)
        self.alternatives = [self._finish(stream, show=number == 1) for number, stream in enumerate(streams, 1)]
        self._end_reply(streams[0])
        for number, stream in enumerate(streams[1:], 2):
            self._print(f"[alternative {number} of {count}]")
            if stream.text:
                self.out.write(stream.text)
            self._end_reply(stream)
        self._print(f"[alternative 1 of {count} is the reply shown; /pick N keeps another, and the others "
                    "stay as branches]")
        return streams

    def _finish(self, stream: RequestStream, show: bool) -> Message | None:
        try:
            return self.conversation.finish_reply(stream, show=show)
        except sqlite3.Error as e:
            self._print(f"error: the reply could not be stored ({e}); /save still writes it to a file")
            return None

    def _end_reply(self, stream: RequestStream) -> None:
        """Ends the reply's text with a new line, and says how it ended where it did not end by itself."""
        if stream.text and not stream.text.endswith("\n"):
            self.out.write("\n")
        footer = {"abort": f"[stopped after {stream.num_completion_tokens} tokens]",
                  "length": f"[cut off at the {stream.num_completion_tokens}-token limit]",
                  "error": f"[error: {stream.error}]"}.get(stream.finish_reason)
        if footer:
            self._print(footer)
        self.out.flush()

    def print_messages(self, messages: list[Message]) -> None:
        """Messages as the REPL showed them when they were sent: the user's after the prompt."""
        for message in messages:
            if message.role == "user":
                self._print(PROMPT + message.content.replace("\n", "\n" + CONTINUATION))
            elif message.role == "tool":
                call = message.answered_call
                self._print(f"[result of {call['function']['name'] if call else 'a tool'}]")
            elif message.content:
                self._print(message.content.rstrip("\n"))

    async def _stream_replies(self, streams: list[RequestStream]) -> None:
        """Streams the first reply to `out` until every one has ended; Ctrl-C stops them all."""
        keyboard = self.session.input
        shown = streams[0]

        def take_keys(keys) -> None:
            if any(k.key in _INTERRUPT_KEYS for k in keys):
                self._abort_replies()
            store_typeahead(keyboard, [k for k in keys if k.key not in _INTERRUPT_KEYS])

        async def drain(stream: RequestStream) -> None:
            async for _ in stream:
                pass

        async def save_every_few_seconds() -> None:
            # What a kill of the process can lose: the last few seconds of each reply, not all of it.
            while True:
                await asyncio.sleep(SAVE_EVERY_S)
                for stream in streams:
                    if stream.finish_reason is None:
                        self._save_so_far(stream)

        self._streaming = streams
        others = [asyncio.ensure_future(drain(stream)) for stream in streams[1:]]
        saver = asyncio.ensure_future(save_every_few_seconds())
        try:
            with keyboard.raw_mode(), keyboard.attach(lambda: take_keys(keyboard.read_keys())):
                # Keys that arrived with the message (sent in the same read) are already parsed.
                take_keys(get_typeahead(keyboard))
                async for delta in shown:
                    if delta.text:
                        self.out.write(delta.text)
                        self.out.flush()
                await asyncio.gather(*others)
        finally:
            for task in (*others, saver):
                task.cancel()
            self._streaming = []

    def _save_so_far(self, stream: RequestStream) -> None:
        try:
            self.conversation.save_reply_so_far(stream)
        except sqlite3.Error as e:  # said once the reply ends, when storing it fails the same way
            self._print(f"\n[the reply so far could not be stored: {e}]")


def run_repl(settings: Settings) -> int:
    """The `--plain` entry point: loads the engine and runs the REPL on the terminal."""
    if not sys.stdin.isatty():
        print("nvchat: --plain reads a terminal; for piped input use -p - (pipe mode)", file=sys.stderr)
        return 2
    history_file = paths.repl_history_file()
    try:  # before the model loads: seconds of loading for nothing otherwise
        history_file.parent.mkdir(parents=True, exist_ok=True)
        store = ChatStore()
    except (OSError, sqlite3.Error) as e:
        print(f"nvchat: can't keep conversations in {paths.data_dir()}: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a store from a newer nvchat
        print(f"nvchat: {e}", file=sys.stderr)
        return 1
    if store.moved_aside is not None:
        print(f"nvchat: the conversation store could not be read; it was moved to {store.moved_aside}",
              file=sys.stderr)
    try:
        verb = "connecting to" if settings.backend else "loading"
        print(f"nvchat: {verb} {settings.model_name}...", file=sys.stderr, flush=True)
        engine = open_backend(settings)
        engine.start()
        startup_trace.mark("ready")
    except (ValueError, RuntimeError, OSError) as e:
        store.close()
        print(f"nvchat: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        store.close()
        return 130
    try:
        with engine:
            repl = Repl(engine, settings, store=store, history=FileHistory(str(history_file)),
                        model_name=model_name(settings, engine),
                        note=GIBBERISH_NOTE if settings.uses_demo_model else None)
            try:
                return repl.run()
            finally:
                repl.conversation.release()
    finally:
        store.close()
