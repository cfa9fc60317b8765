"""The real nvchat process on a pseudo-terminal: bytes in as a terminal sends them."""
import pytest

from tests.app.pty_app import PtyApp


@pytest.fixture
def nvchat_on_a_pty(tmp_path, xdg_cache, app_model_path):
    apps = []

    def start(*args: str) -> PtyApp:
        app = PtyApp(tmp_path, xdg_cache, "--max-model-len", "512", *args)
        apps.append(app)
        return app

    yield start
    for app in apps:
        app.close()


def test_text_and_enter_in_one_write_are_sent_and_stored(nvchat_on_a_pty):
    app = nvchat_on_a_pty("--max-tokens", "16")
    app.wait_ready()
    app.write(b"hello from a terminal\r")
    assert app.wait_until(app.messages, 30, "the stored message")[0] == ("user", "hello from a terminal")
    # A paste (bracketed, as terminals send one) with Enter after it, once the reply is stored.
    app.wait_until(lambda: len(app.messages()) == 2, 60, "the reply")
    app.write(b"\x1b[200~pasted\nlines\x1b[201~\r")
    app.wait_until(lambda: len(app.messages()) >= 3, 30, "the pasted message")
    assert app.messages()[2] == ("user", "pasted\nlines")
    assert app.close() == 0
