"""One conversation: its messages and system prompt, how a turn is sent to the engine, and how
each finished message is stored. Shared by the Textual app and the plain REPL.

Every turn re-sends the whole history through the chat template; the engine's prefix cache turns
the repeated part (system prompt, earlier turns) into cache hits, so only new tokens are computed.
A turn renders and tokenizes its prompt once: on a backend that tokenizes (the local engine) the
conversation measures its prompt as token ids, leaves out its oldest turns if they don't fit, and
submits those ids. A remote backend can't tokenize here: the messages go as they are and the server
renders and tokenizes them, once per turn; it refuses a prompt too long for its context.

Tools: where the conversation has a toolbox (the app's MCP servers), every request offers its tools
in the model's own format (engine.text.tool_calls), or as OpenAI's `tools` to a remote server. A
reply that calls tools is stored with its calls; each call's result (or its refusal) follows as a
"tool" message, and continue_after_tools() asks for the rest of the reply. At most
MAX_TOOL_ROUNDS replies in a row may call tools: the one after them is offered none, so it answers.
"""
import re
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from engine import RequestStream, SamplingParams
from engine.backend import Backend
from engine.text.tool_calls import Tools
from nvchat.settings import Settings

if TYPE_CHECKING:  # start-up: pipe mode keeps no store, and sqlite3 with the store took ~7 ms of its start
    from nvchat.store import ChatStore, WriterLock

_THINK = re.compile(r"<think>(.*?)(?:</think>|$)", re.DOTALL)


def split_thinking(text: str) -> tuple[str | None, str]:
    """Separates a Qwen3 reply's <think>...</think> section (possibly still open) from the answer."""
    match = _THINK.search(text)
    if match is None:
        return None, text
    answer = (text[:match.start()] + text[match.end():]).strip()
    return match.group(1).strip(), answer


def first_line(text: str, limit: int) -> str:
    """The text's first line, cut to `limit` characters with an ellipsis: titles and previews."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


@dataclass(eq=False)  # compared by identity: a message is one node of its conversation's tree
class Message:
    role: str
    content: str
    stats: dict | None = None
    id: int | None = None
    interrupted: bool = False  # a reply that did not end on its own: stopped, failed, or cut off
    parent: "Message | None" = field(default=None, repr=False)
    children: list["Message"] = field(default_factory=list, repr=False)  # oldest first
    selected_at: float = field(default_factory=time.time)  # written, or last chosen among its siblings
    # OpenAI tool_calls entries: an assistant message's calls; a "tool" message's one call it answers.
    tool_calls: list[dict] | None = None

    @property
    def answered_call(self) -> dict | None:
        """The call a "tool" message holds the result of."""
        return self.tool_calls[0] if self.role == "tool" and self.tool_calls else None


# Replies in a row that may call tools; the next is offered none, so that a model calling tools
# again and again still answers the user.
MAX_TOOL_ROUNDS = 5
# A streaming reply is stored this often (and when it ends): what a kill of the process can lose.
SAVE_EVERY_S = 2.0
NOT_RUN = "(the tool was not run: the conversation went on without its result)"


class Toolbox(Protocol):
    @property
    def definitions(self) -> list[dict]:
        """The tools on offer now, as OpenAI function tools."""
        ...


def call_summary(call: dict) -> str:
    """A call as one line: name(arguments)."""
    function = call["function"]
    return f"{function['name']}({function.get('arguments') or ''})"


def _tool_result_entry(call: dict, content: str) -> dict:
    return {"role": "tool", "tool_call_id": call["id"], "content": content}


def reply_stats(stream: RequestStream) -> dict:
    return {"tokens": stream.num_completion_tokens, "tokens_per_s": stream.tokens_per_second,
            "ttft_s": stream.time_to_first_token, "finish_reason": stream.finish_reason,
            "prompt_tokens": stream.num_prompt_tokens, "cached_tokens": stream.num_cached_tokens}


class ReadOnlyConversation(RuntimeError):
    """The conversation is being written by another nvchat process."""


# Alternatives: how many replies one request for them may ask for at once.
MIN_ALTERNATIVES, MAX_ALTERNATIVES, DEFAULT_ALTERNATIVES = 2, 4, 3


class Conversation:
    """A conversation's messages form a tree (editing a message or regenerating a reply adds a
    sibling; nothing is replaced); `messages` is the branch shown, which turns send and exports
    write. `roots` are the first messages: the first one sent and any edits of it."""

    def __init__(self, engine: Backend, store: "ChatStore | None", *, system_prompt: str, model_name: str,
                 settings: Settings, title: str = "New chat", conversation_id: int | None = None,
                 messages: list[Message] | None = None, sampling: dict | None = None, draft: str = "",
                 roots: list[Message] | None = None):
        """messages: the branch shown; without roots, it is the conversation's only branch."""
        self.engine = engine
        self.store = store
        self.system_prompt = system_prompt
        self.model_name = model_name
        self.settings = settings
        self.title = title
        self.id = conversation_id
        self.messages: list[Message] = messages or []
        if roots is None:
            for parent, child in zip(self.messages, self.messages[1:]):
                child.parent = parent
                parent.children = [child]
            roots = self.messages[:1]
        self.roots: list[Message] = roots
        # This conversation's own temperature, top_p, top_k, max_tokens, over settings' defaults.
        self.sampling: dict = dict(sampling or {})
        self._reply_parent: Message | None = None  # what the replies being generated answer
        self._reply_rows: dict[RequestStream, int] = {}  # the stored row of each reply being generated
        self.left_out = 0  # the oldest messages that the last turn's prompt left out to fit the model
        self.draft = draft  # typed and not sent, as last stored
        self._writer: WriterLock | None = None
        # Why this process may not write the conversation (another one is writing it), or None.
        self.read_only: str | None = None
        self.toolbox: Toolbox | None = None  # the tools each request offers (the app's MCP servers)

    @classmethod
    def load(cls, engine: Backend, store: "ChatStore", conversation_id: int, settings: Settings) -> "Conversation":
        """The stored conversation with the branch shown when it was last written, and its writer
        lock; where another process holds that lock it is read-only here (read_only says why)."""
        row = store.get_conversation(conversation_id)
        conversation = cls(engine, store, system_prompt=row.system_prompt, model_name=row.model, settings=settings,
                           title=row.title, conversation_id=row.id, sampling=row.sampling, draft=row.draft, roots=[])
        conversation._take_writer_lock()
        conversation._load_messages()
        return conversation

    def _load_messages(self) -> None:
        nodes: dict[int, Message] = {}
        self.roots = []
        for row in self.store.load_messages(self.id):  # oldest first: a parent before its children
            message = Message(row.role, row.content, row.stats, row.id, interrupted=not row.complete,
                              selected_at=row.selected_at, tool_calls=row.tool_calls)
            nodes[row.id] = message
            parent = nodes.get(row.parent_id)
            message.parent = parent
            (parent.children if parent is not None else self.roots).append(message)
        self.messages = _shown_below(self.roots)

    # --- one writer ----------------------------------------------------------------------------------

    def _take_writer_lock(self) -> bool:
        if self._writer is None and self.store is not None and self.id is not None:
            self._writer = self.store.lock_for_writing(self.id)
            if self._writer is None:
                pid = self.store.writer_pid(self.id)
                self.read_only = ("this conversation is open in another nvchat" + (f" (process {pid})" if pid else "")
                                  + ", which writes it: read-only here until it is closed there")
                return False
        self.read_only = None
        return True

    def try_to_write(self) -> bool:
        """For a read-only conversation: takes the writer lock if the other process let it go, and
        then reads the conversation again, with what that process wrote. True once writable."""
        if self.read_only is None:
            return True
        if not self._take_writer_lock():
            return False
        row = self.store.get_conversation(self.id)
        self.title, self.system_prompt, self.sampling, self.draft = row.title, row.system_prompt, row.sampling or {}, row.draft
        self._load_messages()
        return True

    def _check_writable(self) -> None:
        if self.read_only is not None:
            raise ReadOnlyConversation(self.read_only[0].upper() + self.read_only[1:])

    def release(self) -> None:
        """Lets another process write the conversation (its tab closed, or the program ends)."""
        if self._writer is not None:
            self._writer.release()
            self._writer = None

    # --- persistence ---------------------------------------------------------------------------------

    def _ensure_stored(self) -> None:
        if self.store is not None and self.id is None:
            self.id = self.store.create_conversation(self.title, self.system_prompt, self.model_name)
            self._take_writer_lock()  # nobody else knows it yet
            if self.sampling:
                self.store.set_sampling(self.id, self.sampling)

    def _add(self, message: Message, parent: Message | None, *, complete: bool = True, show: bool = True) -> Message:
        """Stores a new message under parent and puts it in the tree; show: the branch shown then
        ends with it (parent must end it now)."""
        self._check_writable()
        self._ensure_stored()
        if self.store is not None:
            message.id = self.store.add_message(self.id, message.role, message.content, message.stats,
                                                complete=complete, parent_id=parent.id if parent else None,
                                                tool_calls=message.tool_calls)
        message.parent = parent
        (parent.children if parent is not None else self.roots).append(message)
        if show:
            self.messages.append(message)
        return message

    def rename(self, title: str) -> None:
        self._check_writable()
        self.title = title
        if self.store is not None and self.id is not None:
            self.store.rename(self.id, title)

    def save_draft(self, text: str) -> None:
        """Stores what the user typed and has not sent ("" clears it). A chat that exists only as
        an unsaved tab is stored for it, so that its words can be found again with Ctrl+O. Not in a
        read-only conversation: the draft there is the writing process's."""
        if text == self.draft or self.read_only is not None:
            return
        if self.id is None and not text.strip():
            return
        self._ensure_stored()
        if self.store is not None:
            self.store.set_draft(self.id, text)
        self.draft = text

    @property
    def _recommended_sampling(self) -> dict:
        """What the model's checkpoint recommends (a remote backend's model recommends nothing here)."""
        return self.engine.capabilities.recommended_sampling

    def sampling_defaults(self) -> dict:
        """The sampling values this chat follows where it sets none of its own: the settings', else
        the model's recommendation."""
        return self.settings.sampling_defaults(self._recommended_sampling)

    def sampling_params(self) -> SamplingParams:
        return self.settings.sampling_params(recommended=self._recommended_sampling, **self.sampling)

    def check_sampling(self, sampling: dict) -> None:
        """ValueError naming a bad value, where sampling (this chat's own values) can't be used."""
        self.settings.sampling_params(recommended=self._recommended_sampling, **sampling)

    def set_sampling(self, sampling: dict) -> None:
        """Checks the values (ValueError names a bad one), then keeps and stores them."""
        self._check_writable()
        self.check_sampling(sampling)
        self.sampling = dict(sampling)
        self._ensure_stored()
        if self.store is not None:
            self.store.set_sampling(self.id, self.sampling)

    def set_system_prompt(self, text: str) -> None:
        self._check_writable()
        self.system_prompt = text
        if self.store is not None and self.id is not None:
            self.store.set_system_prompt(self.id, text)

    # --- branches ------------------------------------------------------------------------------------

    def siblings(self, message: Message) -> list[Message]:
        """The message and the others in its place: edits of one message, replies to one message."""
        return message.parent.children if message.parent is not None else self.roots

    def branch_position(self, message: Message) -> tuple[int, int]:
        """(which, of how many) among its siblings, from 1: the ◀ 2/3 ▶ the transcript shows."""
        siblings = self.siblings(message)
        return (siblings.index(message) + 1 if message in siblings else 1), max(len(siblings), 1)

    def show_branch(self, message: Message) -> None:
        """Makes the branch shown go through message (any message of the tree), and below it
        along the replies chosen last; stored, so the conversation reopens on it."""
        self._check_writable()
        path, node = [], message
        while node is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        if self.store is not None and message.id is not None:
            self.store.select_message(message.id)
        now = time.time()
        message.selected_at = now
        # Its ancestors are chosen too, so that reopening walks down to it. Only those that were not
        # already: switching one message's sibling writes one row.
        for ancestor in path[:-1]:
            if _latest(self.siblings(ancestor)) is not ancestor:
                if self.store is not None and ancestor.id is not None:
                    self.store.select_message(ancestor.id)
                ancestor.selected_at = now
        self.messages = path + _shown_below(message.children)

    def latest_branching(self) -> int | None:
        """The index of the latest message of the branch shown that has siblings, or None."""
        return next((i for i in range(len(self.messages) - 1, -1, -1)
                     if self.branch_position(self.messages[i])[1] > 1), None)

    def switch_branch(self, index: int, step: int) -> Message:
        """Shows the sibling step places from messages[index] (wrapping around); returns it."""
        message = self.messages[index]
        siblings = self.siblings(message)
        if message not in siblings or len(siblings) < 2:
            raise ValueError("this message has no other branch")
        chosen = siblings[(siblings.index(message) + step) % len(siblings)]
        self.show_branch(chosen)
        return chosen

    def choose_branch(self, index: int, number: int) -> Message:
        """Shows sibling number (from 1) of messages[index]; returns it."""
        siblings = self.siblings(self.messages[index])
        if not 1 <= number <= len(siblings):
            raise ValueError(f"no branch {number} here: this message has {len(siblings)}")
        self.show_branch(siblings[number - 1])
        return siblings[number - 1]

    # --- turns ---------------------------------------------------------------------------------------

    def engine_messages(self, messages: list[Message] | None = None) -> list[dict]:
        """OpenAI chat messages. A call left without its result (the app quit while it waited for
        approval) gets NOT_RUN as its result, as every call must have one."""
        messages = self.messages if messages is None else messages
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        unanswered: list[dict] = []
        for m in messages:
            if m.role == "tool" and m.answered_call is not None:
                unanswered = [c for c in unanswered if c["id"] != m.answered_call["id"]]
                out.append(_tool_result_entry(m.answered_call, m.content))
                continue
            out += [_tool_result_entry(call, NOT_RUN) for call in unanswered]
            unanswered = []
            entry = {"role": m.role, "content": m.content}
            if m.role == "assistant" and m.tool_calls:
                entry["tool_calls"] = m.tool_calls
                unanswered = list(m.tool_calls)
            out.append(entry)
        return out

    def tool_choice(self, round_index: int) -> str | dict:
        """What the model may do with the tools in the round_index-th reply of a turn (0: the first):
        "auto", the model decides."""
        return "auto"

    def _tools(self, messages: list[Message]) -> Tools | None:
        """What a request for a reply to messages offers: the toolbox's tools, none after
        MAX_TOOL_ROUNDS calling replies in a row. Offered none, a conversation holding calls still
        names their functions (choice "none"), so that the model's format renders them."""
        definitions = list(self.toolbox.definitions) if self.toolbox is not None else []
        since_user = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].role == "user"), -1)
        rounds = sum(1 for m in messages[since_user + 1:] if m.role == "assistant" and m.tool_calls)
        if definitions and rounds < MAX_TOOL_ROUNDS:
            return Tools(definitions, choice=self.tool_choice(rounds))
        called = {call["function"]["name"] for m in messages if m.tool_calls for call in m.tool_calls}
        offered = {d["function"]["name"] for d in definitions}
        named = definitions + [{"type": "function", "function": {"name": name, "parameters": {}}}
                               for name in sorted(called - offered)]
        return Tools(named, choice="none") if named else None

    @property
    def max_context(self) -> int | None:
        """The model's context in tokens, where the backend says (a remote one does not)."""
        return self.engine.capabilities.context_length

    def _tokenize(self, messages: list[Message], tools: Tools | None = None) -> list[int]:
        return self.engine.tokenize_chat(self.engine_messages(messages), self.settings.enable_thinking, tools)

    def _fit(self, messages: list[Message], tools: Tools | None = None) -> tuple[int, list[int] | None]:
        """How many of the oldest messages to leave out so that the prompt fits max_model_len with
        room for a reply (a quarter of the context, or max_tokens if less), and the prompt of those
        kept as token ids. The system prompt and the last message always go; a turn goes whole,
        from a user message. With only the last one still too long, the engine's own error says so.
        The whole history is rendered and tokenized once; only a history too long for the context
        takes more, one per step of a binary search over where the kept turns start. (0, None)
        where the backend cannot tokenize."""
        if not self.engine.capabilities.tokenizes:
            return 0, None
        ids = self._tokenize(messages, tools)
        limit = self.max_context
        if limit is None or len(messages) < 2:
            return 0, ids
        budget = limit - min(self.sampling_params().max_tokens, limit // 4)
        if len(ids) <= budget:
            return 0, ids
        # Later starts give shorter prompts: the earliest turn start that fits.
        starts = [i for i, m in enumerate(messages) if i > 0 and m.role == "user"] or [len(messages) - 1]
        tokenized: dict[int, list[int]] = {}
        low, high = 0, len(starts) - 1
        while low < high:
            middle = (low + high) // 2
            tokenized[starts[middle]] = self._tokenize(messages[starts[middle]:], tools)
            if len(tokenized[starts[middle]]) <= budget:
                high = middle
            else:
                low = middle + 1
        start = starts[low]
        if start not in tokenized:  # the latest start, which the search never needed to try
            tokenized[start] = self._tokenize(messages[start:], tools)
        return start, tokenized[start]

    def context_tokens(self, prefetch: bool = False) -> int | None:
        """The tokens of the conversation so far as the next turn will send them (the latest that
        fit), or None where the backend cannot count. prefetch: the engine also starts bringing
        their K/V back from its host and disk tiers (a reopened chat: its next turn then prefills
        only its new message). Tokenizes: off the UI thread."""
        if not self.engine.capabilities.tokenizes or not self.messages:
            return None
        ids = self._fit(self.messages, self._tools(self.messages))[1]
        if prefetch:
            self.engine.prefetch(ids)
        return len(ids)

    def _submit(self, messages: list[Message], count: int = 1) -> list[RequestStream]:
        """Starts count replies to `messages` (as many of the latest as fit) without changing the
        conversation: a rejected prompt (ValueError, e.g. too long) leaves it as it was. Several are
        one request for n samples: the engine prefills their prompt once, and a remote backend sends
        them at once."""
        self._check_writable()
        tools = self._tools(messages)
        left_out, ids = self._fit(messages, tools)
        prompt = self.engine_messages(messages) if ids is None else ids
        params = self.sampling_params()
        if count > 1 and params.greedy:
            raise ValueError("alternatives need sampling: at temperature 0 every reply is the same "
                             "(F7 sets this chat's temperature)")
        if count > 1:
            streams = self.engine.submit_n(prompt, replace(params, n=count),
                                           enable_thinking=self.settings.enable_thinking, tools=tools, tag=self)
        else:
            streams = [self.engine.submit(prompt, params, enable_thinking=self.settings.enable_thinking, tools=tools,
                                          tag=self)]
        self.left_out = left_out
        return streams

    def _start(self, parent: Message | None, streams: list[RequestStream], store_change) -> None:
        """Applies the stored change that goes with started replies (they answer parent); if
        storing fails, the replies are stopped rather than left generating for nobody."""
        try:
            store_change()
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        self._reply_parent = parent

    def last_user_index(self) -> int | None:
        """The index of the user's last message in the branch shown, or None."""
        return max((i for i, m in enumerate(self.messages) if m.role == "user"), default=None)

    def _last_user_index(self, what: str) -> int:
        index = self.last_user_index()
        if index is None:
            raise ValueError(f"nothing to {what}: the conversation has no message yet")
        return index

    def send(self, text: str, alternatives: int = 1) -> RequestStream | list[RequestStream]:
        """Stores the user's message and starts the reply (or `alternatives` replies: a list)."""
        parent = self.messages[-1] if self.messages else None
        message = Message("user", text)
        streams = self._submit(self.messages + [message], _alternatives(alternatives))
        self._start(message, streams, lambda: self._add(message, parent))
        try:
            self.save_draft("")  # it was the draft, now sent
        except Exception:  # the message and its reply stand; at worst the old draft comes back
            pass
        return streams if alternatives > 1 else streams[0]

    def _reply_parent_index(self, index: int | None, what: str) -> int:
        """The message a new reply at `index` answers: the one before a reply, a user message
        itself; by default the last user message."""
        if index is None:
            return self._last_user_index(what)
        if not 0 <= index < len(self.messages):
            raise ValueError(f"no message {index + 1} to {what}")
        return index - 1 if self.messages[index].role == "assistant" else index

    def regenerate(self, index: int | None = None, alternatives: int = 1) -> RequestStream | list[RequestStream]:
        """A new reply (or `alternatives` of them) beside the reply at messages[index], or to the
        user message there (default: the last one); the reply it replaces stays, as a branch."""
        at = self._reply_parent_index(index, "regenerate")
        if at < 0:
            raise ValueError("nothing to regenerate: no message comes before this one")
        parent = self.messages[at]
        streams = self._submit(self.messages[:at + 1], _alternatives(alternatives))

        def store_change():
            self._check_writable()
            del self.messages[at + 1:]

        self._start(parent, streams, store_change)
        return streams if alternatives > 1 else streams[0]

    def edit(self, index: int, text: str) -> RequestStream:
        """Sends text in place of the user message at messages[index] (a new branch beside it,
        which keeps it and what followed it) and starts the reply."""
        if not (0 <= index < len(self.messages) and self.messages[index].role == "user"):
            raise ValueError("only your own messages can be edited")
        old = self.messages[index]
        message = Message("user", text)
        [stream] = self._submit(self.messages[:index] + [message])

        def store_change():
            self._check_writable()
            del self.messages[index:]
            self._add(message, old.parent)

        self._start(message, [stream], store_change)
        return stream

    def edit_last_user(self, text: str) -> RequestStream:
        """edit() of the last user message."""
        return self.edit(self._last_user_index("edit"), text)

    @property
    def pending_tool_calls(self) -> list[dict]:
        """The last reply's calls that have no result yet, where the conversation ends with them."""
        answered = set()
        for m in reversed(self.messages):
            if m.role == "tool" and m.answered_call is not None:
                answered.add(m.answered_call["id"])
            elif m.role == "assistant" and m.tool_calls:
                return [call for call in m.tool_calls if call["id"] not in answered]
            else:
                break
        return []

    def add_tool_result(self, call: dict, content: str, error: bool = False) -> Message:
        """Stores a call's result (its text, or why it failed or did not run) as a "tool" message."""
        parent = self.messages[-1] if self.messages else None
        return self._add(Message("tool", content, {"error": True} if error else None, tool_calls=[call]), parent)

    def continue_after_tools(self) -> RequestStream:
        """Asks for the rest of the reply, now that its calls have their results."""
        if self.pending_tool_calls or not (self.messages and self.messages[-1].role == "tool"):
            raise ValueError("nothing to continue: the conversation does not end with every call's result")
        [stream] = self._submit(self.messages)
        self._start(self.messages[-1], [stream], lambda: None)
        return stream

    def save_reply_so_far(self, stream: RequestStream) -> None:
        """Stores the reply's text so far, marked incomplete, so a kill loses at most what came since."""
        text = stream.text
        if not text or self.store is None:
            return
        row = self._reply_rows.get(stream)
        if row is None:
            self._ensure_stored()
            parent = self._reply_parent
            self._reply_rows[stream] = self.store.add_message(self.id, "assistant", text, complete=False,
                                                              parent_id=parent.id if parent else None)
        else:
            self.store.update_message(row, text, complete=False)

    def finish_reply(self, stream: RequestStream, show: bool = True) -> Message | None:
        """Stores an ended reply with its numbers, under the message it answers; show: the branch
        shown then ends with it (False for alternatives but the first one shown). Stopped and failed
        replies keep what was generated, marked interrupted; a reply that failed with nothing
        generated is not stored."""
        saved = self._reply_rows.pop(stream, None)
        parent = self._reply_parent
        text, stats = stream.text, reply_stats(stream)
        interrupted = stream.finish_reason in ("abort", "error")
        # An interrupted reply's calls are not run: the user stopped it, or it failed.
        calls = [call.openai() for call in stream.tool_calls] if not interrupted else None
        if not text and not calls and stream.finish_reason == "error":
            if saved is not None:
                self.store.delete_message(saved)
            return None
        message = Message("assistant", text, stats, interrupted=interrupted, parent=parent, tool_calls=calls or None)
        if saved is None:
            self._ensure_stored()
            if self.store is not None:
                message.id = self.store.add_message(self.id, "assistant", text, stats, complete=not interrupted,
                                                    parent_id=parent.id if parent else None,
                                                    tool_calls=message.tool_calls)
        else:
            self.store.update_message(saved, text, stats, complete=not interrupted, tool_calls=message.tool_calls)
            message.id = saved
        (parent.children if parent is not None else self.roots).append(message)
        if show and (self.messages[-1] if self.messages else None) is parent:
            self.messages.append(message)
        return message

    @property
    def last_user_text(self) -> str | None:
        return next((m.content for m in reversed(self.messages) if m.role == "user"), None)

    def to_markdown(self) -> str:
        lines = [f"# {self.title}", "", f"*Model: {self.model_name}*", ""]
        if self.system_prompt:
            lines += ["## System", "", self.system_prompt, ""]
        for m in self.messages:
            if m.role == "tool":
                call = m.answered_call
                lines += [f"## Tool result: {call['function']['name'] if call else 'tool'}", "", "```",
                          m.content, "```", ""]
                continue
            lines += [f"## {m.role.capitalize()}", "", m.content, ""]
            for call in m.tool_calls or ():
                lines += [f"*Calls `{call_summary(call)}`*", ""]
            if m.stats and m.stats.get("tokens"):
                tps = m.stats.get("tokens_per_s")
                lines += [f"*{m.stats['tokens']} tokens" + (f", {tps:.1f} tok/s*" if tps else "*"), ""]
        return "\n".join(lines)


def _latest(siblings: list[Message]) -> Message:
    """The sibling chosen last (the later one where two were chosen at the same time)."""
    return max(enumerate(siblings), key=lambda pair: (pair[1].selected_at, pair[0]))[1]


def _shown_below(level: list[Message]) -> list[Message]:
    """From a level of siblings down: the one chosen last, then its child chosen last, and so on."""
    branch = []
    while level:
        branch.append(_latest(level))
        level = branch[-1].children
    return branch


def _alternatives(count: int) -> int:
    if count != 1 and not MIN_ALTERNATIVES <= count <= MAX_ALTERNATIVES:
        raise ValueError(f"alternatives: {MIN_ALTERNATIVES} to {MAX_ALTERNATIVES} replies at once, not {count}")
    return count
