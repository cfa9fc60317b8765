"""A saved tokenizer (tokenizer.json, tokenizer_config.json, its chat template) through the
`tokenizers` library and jinja2 directly, without transformers: loading transformers' tokenizer
classes took ~1 s of CPU at every start on the 2-core box, to call into the same Rust tokenizer.

ChatTokenizer does what the engine asks of a tokenizer, as transformers' generic fast tokenizer
does it: encode, decode, and apply_chat_template rendered in the sandboxed jinja2 environment
transformers builds for chat templates. It is used only for a tokenizer transformers would run as
its generic backend (usable() says which); tests/test_chat_tokenizer.py checks it token for token
and character for character against transformers' AutoTokenizer."""
import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

# transformers' generic fast tokenizer classes: they run tokenizer.json as it is saved. A
# model-specific class (Qwen2Tokenizer, LlamaTokenizer...) rebuilds parts of the pipeline itself.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_config(path: Path) -> dict | None:
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _chat_template(path: Path, config: dict) -> str | None | bool:
    """The template text, None if there is none, False if it is in a form only transformers reads
    (several named templates)."""
    file = path / "chat_template.jinja"
    if file.exists():
        return file.read_text()
    template = config.get("chat_template")
    if template is None or isinstance(template, str):
        return template
    return False


def usable(path: Path, any_class: bool = False) -> bool:
    """Whether the tokenizer saved in path runs the same through ChatTokenizer as through
    transformers: a tokenizer.json run as saved (any_class: whatever class saved it, as for the
    tokenizers nvchat itself saves from a transformers object, whose tokenizer.json holds the
    pipeline that object ran), no text clean-up after decoding, no special tokens split, no BOS
    or EOS switches over the saved post-processor, and one chat template or none."""
    config = _read_config(path)
    if config is None or not (path / "tokenizer.json").exists():
        return False
    if not any_class and config.get("tokenizer_class") not in GENERIC_CLASSES:
        return False
    if config.get("clean_up_tokenization_spaces") or config.get("split_special_tokens"):
        return False
    if "add_bos_token" in config or "add_eos_token" in config:
        return False
    return _chat_template(path, config) is not False


class _GenerationTag(Extension):
    """transformers' {% generation %} block (it marks assistant text for training masks): here it
    renders its body, as transformers does when no mask is asked for."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # As transformers' filter: jinja2's own escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace() without underscore-prefixed attributes, as transformers allows."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates can't set attribute {name!r} on a namespace")


def compile_chat_template(template: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it: sandboxed, blocks trimmed, with its
    loop controls, tojson, raise_exception, strftime_now and namespace."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = dict
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


class ChatTokenizer:
    def __init__(self, path: Path):
        """The tokenizer saved in path (check usable(path) first)."""
        config = _read_config(path) or {}
        self.backend_tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.chat_template = _chat_template(path, config) or None
        self._compiled = None
        self.special_tokens_map = {name: text for name in SPECIAL_TOKEN_NAMES
                                   if (text := _token_text(config.get(name))) is not None}
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        self._extra_special = [t for t in map(_token_text, extra if isinstance(extra, list) else []) if t]
        self.bos_token_id = self.token_to_id(self.special_tokens_map.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.special_tokens_map.get("eos_token"))
        self.clean_up_tokenization_spaces = False

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    @property
    def all_special_ids(self) -> list[int]:
        tokens = dict.fromkeys([*self.special_tokens_map.values(), *self._extra_special])
        return [i for i in map(self.token_to_id, tokens) if i is not None]

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, tokenize: bool = True, add_generation_prompt: bool = False,
                            **kwargs):
        """The messages rendered through the chat template with transformers' variables (the special
        tokens by name, tools and documents unset) and kwargs; their token ids if tokenize."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        # Compiled once per template text: a caller may set chat_template (a server's override, a test).
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, compile_chat_template(self.chat_template))
        # transformers drops keys whose value is None: templates handle a missing key, not None.
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self._compiled[1].render(messages=messages, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text
