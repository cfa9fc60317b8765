"""Fixtures for driving the real app with Pilot against the real demo model on CPU.

One engine serves every test that does not need its own (start-up, snapshots): building one takes
a couple of seconds, and a reply of a few dozen tokens a fraction of one.
"""
from dataclasses import dataclass

import pytest

from engine import EngineThread
from engine.checkpoints.demo_model import ensure_demo_model
from nvchat.app import NvchatApp
from nvchat.settings import Settings

ENGINE_ARGS = dict(device="cpu", max_model_len=512, max_num_seqs=8)


@dataclass
class FixedLengthSettings(Settings):
    """Replies run to max_tokens, so a test knows how long one lasts (the demo model otherwise
    stops whenever it happens to sample the end-of-turn token)."""

    def sampling_params(self, **overrides):
        return super().sampling_params(ignore_eos=True, **overrides)


def app_settings(**changes) -> Settings:
    # No disk tier unless a test asks for one: it would live in the session's shared cache
    # directory, and one test's saved blocks would be another's prefix hits.
    values = dict(**ENGINE_ARGS, model="demo", max_tokens=24, temperature=0.8, disk_cache_gib=0)
    values.update(changes)
    return FixedLengthSettings(**values)


@pytest.fixture(scope="session")
def xdg_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(scope="session")
def app_model_path(xdg_cache):
    """The demo model where the app itself looks for it (XDG_CACHE_HOME/nvchat)."""
    return ensure_demo_model(xdg_cache / "nvchat")


@pytest.fixture(autouse=True)
def xdg_dirs(tmp_path, monkeypatch, xdg_cache):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg_cache))
    monkeypatch.chdir(tmp_path)  # Markdown exports land in the current directory
    return tmp_path


@pytest.fixture(scope="session")
def shared_engine(app_model_path):
    engine = EngineThread(str(app_model_path), **ENGINE_ARGS).start()
    yield engine
    engine.shutdown()


@pytest.fixture
def make_app(shared_engine):
    def make(**changes) -> NvchatApp:
        return NvchatApp(app_settings(**changes), engine=shared_engine)
    return make


@pytest.fixture(scope="session")
def idle_engine(app_model_path):
    """An engine that never serves a request, so that what the KV panel shows is the same every run."""
    engine = EngineThread(str(app_model_path), **ENGINE_ARGS, num_kvcache_blocks=1024).start()
    yield engine
    engine.shutdown()
