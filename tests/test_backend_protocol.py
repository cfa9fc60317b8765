"""EngineThread and RemoteBackend both implement the declared Backend protocol (engine/backend.py):
every member is there with the protocol's signature, and each says what it can do as data."""
import inspect
import typing

import pytest

from engine import EngineThread
from engine.backend import Backend, BackendCapabilities, EngineSnapshot
from nvchat.remote_backend import RemoteBackend

_DUNDERS = {"__enter__", "__exit__"}


def protocol_members() -> tuple[set[str], set[str]]:
    """The protocol's data members (annotated attributes and properties) and its methods."""
    data = set(Backend.__annotations__)
    methods = set()
    for name, value in vars(Backend).items():
        if name.startswith("_") and name not in _DUNDERS:
            continue
        if isinstance(value, property):
            data.add(name)
        elif inspect.isfunction(value):
            methods.add(name)
    return data, methods


def parameters(function) -> list[tuple]:
    signature = inspect.signature(function, eval_str=True)
    return [(p.name, p.kind, p.default, p.annotation) for p in signature.parameters.values()]


def returns_fit(cls, given, declared) -> bool:
    """Whether a method's return annotation is the protocol's or narrower (a subclass, one side of
    a union, the class itself for Self)."""
    if declared is inspect.Signature.empty or given == declared:
        return True
    if declared is typing.Self:
        return given is cls
    allowed = typing.get_args(declared) or (declared,)
    given = type(None) if given is None else given  # how a signature spells `-> None`
    return all(any(g == a or (inspect.isclass(g) and inspect.isclass(a) and issubclass(g, a)) for a in allowed)
               for g in (typing.get_args(given) or (given,)))


@pytest.fixture(scope="module")
def engine(demo_model_path):
    engine = EngineThread(str(demo_model_path), device="cpu", max_model_len=256)
    yield engine
    engine.shutdown()


@pytest.fixture
def remote():
    return RemoteBackend("http://127.0.0.1:9/v1", model="served-model")  # never started: nothing is reached


def test_the_protocol_declares_what_the_app_and_server_use():
    data, methods = protocol_members()
    assert data == {"fatal_error", "capabilities"}
    assert methods == {"start", "shutdown", "__enter__", "__exit__", "submit", "submit_n", "tokenize_chat", "tokenize",
                       "detokenize", "prefetch", "stats"}


@pytest.mark.parametrize("which", ["engine", "remote"])
def test_both_backends_have_every_member_with_the_protocols_signature(which, request):
    backend = request.getfixturevalue(which)
    cls = type(backend)
    data, methods = protocol_members()
    for name in data:
        assert hasattr(backend, name), f"{cls.__name__} lacks {name}"
    assert isinstance(backend.capabilities, BackendCapabilities)
    assert backend.fatal_error is None
    for name in methods:
        declared, given = getattr(Backend, name), getattr(cls, name, None)
        assert callable(given), f"{cls.__name__} lacks {name}()"
        # Parameters past self: names, kinds, defaults, and the protocol's annotations where it has them.
        want, have = parameters(declared)[1:], parameters(given)[1:]
        assert [p[:3] for p in have] == [p[:3] for p in want], f"{cls.__name__}.{name}: {have} != {want}"
        for (pname, _, _, wanted), (_, _, _, annotation) in zip(want, have):
            assert wanted is inspect.Parameter.empty or annotation == wanted, f"{cls.__name__}.{name}({pname})"
        declared_return = inspect.signature(declared, eval_str=True).return_annotation
        given_return = inspect.signature(given, eval_str=True).return_annotation
        if given_return is not inspect.Signature.empty:
            assert returns_fit(cls, given_return, declared_return), f"{cls.__name__}.{name} returns {given_return}"


def test_the_local_engine_tokenizes_and_shows_its_blocks(engine):
    assert engine.capabilities == BackendCapabilities(model_name=None, context_length=256, tokenizes=True,
                                                      block_stats=True)
    assert isinstance(engine.stats(), EngineSnapshot)
    ids = engine.tokenize_chat([{"role": "user", "content": "Hi"}])
    assert ids and all(isinstance(t, int) for t in ids)
    assert engine.detokenize(ids).endswith("<|im_start|>assistant\n")
    assert engine.detokenize(engine.tokenize("Hi there")) == "Hi there"


def test_a_remote_backend_says_it_can_neither_tokenize_nor_show_blocks(remote):
    assert remote.capabilities == BackendCapabilities(model_name="served-model", context_length=None,
                                                      tokenizes=False, block_stats=False)
    assert remote.stats() is None
    with pytest.raises(RuntimeError, match="tokenizes its prompts itself"):
        remote.tokenize_chat([{"role": "user", "content": "Hi"}])
    with pytest.raises(RuntimeError, match="tokenizes its prompts itself"):
        remote.tokenize("Hi")
    with pytest.raises(RuntimeError, match="not reachable"):
        remote.detokenize([1, 2])
