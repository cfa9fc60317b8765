"""`nvchat serve`: binds the socket, loads the engine behind it, serves until Ctrl-C or SIGTERM.

The socket is bound before the model loads, so clients get 503 rather than a refused connection
while it loads, and `--port 0` works: the bound address is printed on stderr. On a signal the
server stops accepting, ends the open requests (streams get an error event), and only then shuts
the engine and its workers down.
"""
import argparse
import contextlib
import socket
import sys
import threading

import uvicorn

from engine import EngineThread
from nvchat import default_model
from nvchat.flags import CommandLineParser, add_engine_flags, settings_from_args
from nvchat.server.app import DEFAULT_MAX_REQUEST_BYTES, ServerState, create_app
from nvchat.settings import Settings, SettingsError

# A request still open this long after a shutdown began is cut off (its engine request is
# already aborted by then; this only bounds a client that stops reading).
GRACEFUL_SHUTDOWN_S = 5
# The event loop's thread and the engine's share the GIL; as in the app, a short switch interval
# keeps the engine from waiting up to 5 ms for it after each step.
GIL_SWITCH_INTERVAL_S = 0.0005


def build_parser() -> argparse.ArgumentParser:
    p = CommandLineParser(prog="nvchat serve", description="Serve the engine over the OpenAI API.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every route but /health")
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model as given, else "
                                                        f"{default_model.NAME}, or 'demo' without {default_model.DISTRIBUTION})")
    p.add_argument("--max-request-bytes", type=_positive, default=DEFAULT_MAX_REQUEST_BYTES, metavar="N",
                   help=f"a bigger request body is refused with 413 (default {DEFAULT_MAX_REQUEST_BYTES}, 16 MiB)")
    add_engine_flags(p)
    return p


def _positive(text: str) -> int:
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return value


def _port(text: str) -> int:
    port = int(text) if text.strip().isdigit() else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535)")
    return port


class _Server(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.nvchat_state = state

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises a caught SIGINT/SIGTERM once it has stopped serving, which would kill
        # the process before run_serve shuts the engine and its workers down; forget it instead.
        with super().capture_signals():
            try:
                yield
            finally:
                self._captured_signals.clear()

    async def shutdown(self, sockets=None):
        self.nvchat_state.begin_shutdown()
        await super().shutdown(sockets)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"can't listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _say(message: str) -> None:
    print(f"nvchat: {message}", file=sys.stderr, flush=True)


def _api_model_id(settings: Settings) -> str:
    """The model's id in the API: --model as given, else the default model's name (no spaces)."""
    if settings.model or settings.uses_demo_model:
        return settings.model or "demo"
    return default_model.NAME


def run_serve(settings: Settings, *, host: str, port: int, api_key: str | None = None,
              model_name: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> int:
    try:
        model = settings.engine_model()
        sock = _bind(host, port)
    except (ValueError, OSError) as e:
        _say(str(e))
        return 1
    state = ServerState(model_name or _api_model_id(settings), max_request_bytes=max_request_bytes)
    config = uvicorn.Config(create_app(state, api_key=api_key), log_level="warning", access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config, state)
    bound_host, bound_port = sock.getsockname()[:2]
    url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}/v1"
    _say(f"listening on {url}; loading {settings.model_name}...")

    def load() -> None:
        try:
            engine = EngineThread(model, **settings.engine_options().keywords())
        except Exception as e:  # reported, and the server stops: it has nothing to serve
            state.load_error = str(e) or type(e).__name__
            _say(f"the model could not be loaded: {state.load_error}")
            server.should_exit = True
            return
        state.engine = engine.start()
        _say(f"ready: serving {state.model_name!r} at {url}")

    loader = threading.Thread(target=load, name="nvchat-load", daemon=True)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:
        loader.start()
        server.run(sockets=[sock])
    finally:
        sys.setswitchinterval(switch_interval)
        state.begin_shutdown()
        loader.join()  # a load in progress is finished, then shut down: its workers must not be orphaned
        if state.engine is not None:
            state.engine.shutdown()
        sock.close()
        _say("stopped")
    return 1 if state.load_error else 0


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from_args(args)
    except (SettingsError, ValueError) as e:  # config.toml, or a value the engine refuses
        _say(str(e))
        return 2
    return run_serve(settings, host=args.host, port=args.port, api_key=args.api_key,
                     model_name=args.served_model_name, max_request_bytes=args.max_request_bytes)
