"""One conversation: its messages and system prompt, how a turn is sent to the engine, and how
each finished message is stored. Shared by the Textual app and the plain REPL.

Every turn re-sends the whole history through the chat template; the engine's prefix cache turns
the repeated part (system prompt, earlier turns) into cache hits, so only new tokens are computed.
A turn renders and tokenizes its prompt once: on a backend that tokenizes (the local engine) the
conversation measures its prompt as token ids, leaves out its oldest turns if they don't fit, and
submits those ids. A remote backend can't tokenize here: the messages go as they are and the server
renders and tokenizes them, once per turn; it refuses a prompt too long for its context.
"""
import re
from dataclasses import dataclass

from engine import RequestStream, SamplingParams
from engine.backend import Backend
from nvchat.settings import Settings
from nvchat.store import ChatStore

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


@dataclass
class Message:
    role: str
    content: str
    stats: dict | None = None
    id: int | None = None
    interrupted: bool = False  # a reply that did not end on its own: stopped, failed, or cut off


def reply_stats(stream: RequestStream) -> dict:
    return {"tokens": stream.num_completion_tokens, "tokens_per_s": stream.tokens_per_second,
            "ttft_s": stream.time_to_first_token, "finish_reason": stream.finish_reason,
            "prompt_tokens": stream.num_prompt_tokens, "cached_tokens": stream.num_cached_tokens}


class Conversation:
    def __init__(self, engine: Backend, store: ChatStore | None, *, system_prompt: str, model_name: str,
                 settings: Settings, title: str = "New chat", conversation_id: int | None = None,
                 messages: list[Message] | None = None, sampling: dict | None = None, draft: str = ""):
        self.engine = engine
        self.store = store
        self.system_prompt = system_prompt
        self.model_name = model_name
        self.settings = settings
        self.title = title
        self.id = conversation_id
        self.messages: list[Message] = messages or []
        # This conversation's own temperature, top_p, top_k, max_tokens, over settings' defaults.
        self.sampling: dict = dict(sampling or {})
        self._reply_id: int | None = None  # the stored row of the reply being generated
        self.left_out = 0  # the oldest messages that the last turn's prompt left out to fit the model
        self.draft = draft  # typed and not sent, as last stored

    @classmethod
    def load(cls, engine: Backend, store: ChatStore, conversation_id: int, settings: Settings) -> "Conversation":
        row = store.get_conversation(conversation_id)
        messages = [Message(m.role, m.content, m.stats, m.id, interrupted=not m.complete)
                    for m in store.load_messages(conversation_id)]
        return cls(engine, store, system_prompt=row.system_prompt, model_name=row.model, settings=settings,
                   title=row.title, conversation_id=row.id, messages=messages, sampling=row.sampling,
                   draft=row.draft)

    # --- persistence ---------------------------------------------------------------------------------

    def _ensure_stored(self) -> None:
        if self.store is not None and self.id is None:
            self.id = self.store.create_conversation(self.title, self.system_prompt, self.model_name)
            if self.sampling:
                self.store.set_sampling(self.id, self.sampling)

    def _append(self, message: Message) -> Message:
        self._ensure_stored()
        if self.store is not None:
            message.id = self.store.add_message(self.id, message.role, message.content, message.stats)
        self.messages.append(message)
        return message

    def _drop_from(self, index: int) -> None:
        for message in self.messages[index:]:
            if self.store is not None and message.id is not None:
                self.store.delete_message(message.id)
        del self.messages[index:]

    def rename(self, title: str) -> None:
        self.title = title
        if self.store is not None and self.id is not None:
            self.store.rename(self.id, title)

    def save_draft(self, text: str) -> None:
        """Stores what the user typed and has not sent ("" clears it). A chat that exists only as
        an unsaved tab is stored for it, so that its words can be found again with Ctrl+O."""
        if text == self.draft:
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

    def set_sampling(self, sampling: dict) -> None:
        """Checks the values (ValueError names a bad one), then keeps and stores them."""
        self.settings.sampling_params(recommended=self._recommended_sampling, **sampling)
        self.sampling = dict(sampling)
        self._ensure_stored()
        if self.store is not None:
            self.store.set_sampling(self.id, self.sampling)

    def set_system_prompt(self, text: str) -> None:
        self.system_prompt = text
        if self.store is not None and self.id is not None:
            self.store.set_system_prompt(self.id, text)

    # --- turns ---------------------------------------------------------------------------------------

    def engine_messages(self, messages: list[Message] | None = None) -> list[dict]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return system + [{"role": m.role, "content": m.content} for m in (self.messages if messages is None else messages)]

    @property
    def max_context(self) -> int | None:
        """The model's context in tokens, where the backend says (a remote one does not)."""
        return self.engine.capabilities.context_length

    def _tokenize(self, messages: list[Message]) -> list[int]:
        return self.engine.tokenize_chat(self.engine_messages(messages), self.settings.enable_thinking)

    def _fit(self, messages: list[Message]) -> tuple[int, list[int] | None]:
        """How many of the oldest messages to leave out so that the prompt fits max_model_len with
        room for a reply (a quarter of the context, or max_tokens if less), and the prompt of those
        kept as token ids. The system prompt and the last message always go; a turn goes whole,
        from a user message. With only the last one still too long, the engine's own error says so.
        The whole history is rendered and tokenized once; only a history too long for the context
        takes more, one per step of a binary search over where the kept turns start. (0, None)
        where the backend cannot tokenize."""
        if not self.engine.capabilities.tokenizes:
            return 0, None
        ids = self._tokenize(messages)
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
            tokenized[starts[middle]] = self._tokenize(messages[starts[middle]:])
            if len(tokenized[starts[middle]]) <= budget:
                high = middle
            else:
                low = middle + 1
        start = starts[low]
        if start not in tokenized:  # the latest start, which the search never needed to try
            tokenized[start] = self._tokenize(messages[start:])
        return start, tokenized[start]

    def context_tokens(self) -> int | None:
        """The tokens of the conversation so far as the next turn will send them (the latest that
        fit), or None where the backend cannot count. Tokenizes: off the UI thread."""
        if not self.engine.capabilities.tokenizes or not self.messages:
            return None
        return len(self._fit(self.messages)[1])

    def _submit(self, messages: list[Message]) -> RequestStream:
        """Starts a reply to `messages` (as many of the latest as fit) without changing the
        conversation: a rejected prompt (ValueError, e.g. too long) leaves it as it was."""
        left_out, ids = self._fit(messages)
        prompt = self.engine_messages(messages) if ids is None else ids
        stream = self.engine.submit(prompt, self.sampling_params(), enable_thinking=self.settings.enable_thinking,
                                    tag=self)
        self.left_out = left_out
        return stream

    @staticmethod
    def _then_store(stream: RequestStream, store_change) -> RequestStream:
        """Applies the stored change that goes with a started reply; if storing fails, the reply
        is stopped rather than left generating for nobody."""
        try:
            store_change()
        except BaseException:
            stream.abort()
            raise
        return stream

    def _last_user_index(self, what: str) -> int:
        index = max((i for i, m in enumerate(self.messages) if m.role == "user"), default=None)
        if index is None:
            raise ValueError(f"nothing to {what}: the conversation has no message yet")
        return index

    def send(self, text: str) -> RequestStream:
        """Stores the user's message and starts the reply."""
        stream = self._submit(self.messages + [Message("user", text)])
        stream = self._then_store(stream, lambda: self._append(Message("user", text)))
        try:
            self.save_draft("")  # it was the draft, now sent
        except Exception:  # the message and its reply stand; at worst the old draft comes back
            pass
        return stream

    def regenerate(self) -> RequestStream:
        """Drops the last reply and asks again."""
        last_user = self._last_user_index("regenerate")
        stream = self._submit(self.messages[:last_user + 1])
        return self._then_store(stream, lambda: self._drop_from(last_user + 1))

    def edit_last_user(self, text: str) -> RequestStream:
        """Replaces the last user message (dropping the reply to it) and asks again."""
        last_user = self._last_user_index("edit")

        def store_change():
            self._drop_from(last_user)
            self._append(Message("user", text))

        stream = self._submit(self.messages[:last_user] + [Message("user", text)])
        return self._then_store(stream, store_change)

    def save_reply_so_far(self, stream: RequestStream) -> None:
        """Stores the reply's text so far, marked incomplete, so a kill loses at most what came since."""
        text = stream.text
        if not text or self.store is None:
            return
        if self._reply_id is None:
            self._ensure_stored()
            self._reply_id = self.store.add_message(self.id, "assistant", text, complete=False)
        else:
            self.store.update_message(self._reply_id, text, complete=False)

    def finish_reply(self, stream: RequestStream) -> Message | None:
        """Stores an ended reply with its numbers. Stopped and failed replies keep what was generated,
        marked interrupted; a reply that failed with nothing generated is not stored."""
        saved, self._reply_id = self._reply_id, None
        text, stats = stream.text, reply_stats(stream)
        interrupted = stream.finish_reason in ("abort", "error")
        if not text and stream.finish_reason == "error":
            if saved is not None:
                self.store.delete_message(saved)
            return None
        message = Message("assistant", text, stats, interrupted=interrupted)
        if saved is None:
            self._ensure_stored()
            if self.store is not None:
                message.id = self.store.add_message(self.id, "assistant", text, stats, complete=not interrupted)
        else:
            self.store.update_message(saved, text, stats, complete=not interrupted)
            message.id = saved
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
            lines += [f"## {m.role.capitalize()}", "", m.content, ""]
            if m.stats and m.stats.get("tokens"):
                tps = m.stats.get("tokens_per_s")
                lines += [f"*{m.stats['tokens']} tokens" + (f", {tps:.1f} tok/s*" if tps else "*"), ""]
        return "\n".join(lines)
