"""nvchat as a user runs it: a real process on a pseudo-terminal, fed bytes as a terminal sends
them, with what it stored read back from its SQLite file."""
from __future__ import annotations

import fcntl
import os
import pty
import signal
import sqlite3
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# How long a wait on the process may take before it counts as a hang. Generous: a passing run never
# waits this long, and on a loaded 2-core box the process starts (importing torch, loading the
# model), replies and exits several times slower than alone.
PATIENCE_S = 180.0


class PtyApp:
    def __init__(self, home: Path, cache: Path, *args: str, size: tuple[int, int] = (160, 48)) -> None:
        self.database = home / "data" / "nvchat" / "conversations.sqlite3"
        env = dict(os.environ, XDG_CONFIG_HOME=str(home / "config"), XDG_DATA_HOME=str(home / "data"),
                   XDG_CACHE_HOME=str(cache), TERM="xterm-256color", PYTHONPATH=str(REPO))
        env.pop("TEXTUAL", None)
        self.fd, child = pty.openpty()
        columns, rows = size
        fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        # The KV cache's disk tier in the test's own directory, as the session's shared cache would
        # hand one test's saved blocks to another as prefix hits (and change the greedy replies
        # where a CPU rounds a shorter prefill otherwise).
        self.process = subprocess.Popen([sys.executable, "-m", "nvchat.cli", "--device", "cpu",
                                         "--disk-cache-dir", str(home / "kv"), *args],
                                        stdin=child, stdout=child, stderr=child, cwd=home, env=env,
                                        start_new_session=True)
        os.close(child)
        self._output = bytearray()
        self._output_grew = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # the process exited and the terminal closed
                return
            if not data:
                return
            with self._output_grew:
                self._output += data
                self._output_grew.notify_all()

    @property
    def output(self) -> str:
        with self._output_grew:
            return self._output.decode("utf-8", "replace")

    def write(self, data: bytes) -> None:
        """One write, so the app reads it as one burst, as from a paste or tmux send-keys."""
        os.write(self.fd, data)

    def wait_until(self, condition, what: str, timeout: float = PATIENCE_S):
        deadline = time.monotonic() + timeout
        while True:
            value = condition()
            if value:
                return value
            if self.process.poll() is not None:
                raise AssertionError(f"nvchat exited ({self.process.returncode}) while waiting for {what}:\n"
                                     f"{self.output[-2000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout}s waiting for {what}")
            with self._output_grew:
                # Woken by new output; conditions on the database are checked again every 50 ms.
                self._output_grew.wait(0.05)

    def wait_ready(self, timeout: float = PATIENCE_S) -> None:
        """Until the first chat is on screen (its hint names the send key) and takes the app's keys.
        The hint can be drawn before the app is ready (its tab is drawn while it mounts; 1 of 3
        starts), and a chat key such as Ctrl+O that arrives then is dropped; the footer lists the
        chat keys (Ctrl+W's "Close chat") only once the app is ready."""
        self.wait_until(lambda: "Enter sends" in self.output and "Close chat" in self.output,
                        "the first chat, ready for keys", timeout)

    def wait_output_read(self, timeout: float = PATIENCE_S) -> None:
        """Until every byte the process wrote has been read: after it exits, the terminal closes
        once the reader has taken what was left in it."""
        self._reader.join(timeout)
        assert not self._reader.is_alive(), f"the terminal still open {timeout}s after the process ended"

    def query(self, sql: str, args=()) -> list[tuple]:
        if not self.database.exists():
            return []
        db = sqlite3.connect(f"file:{self.database}?mode=ro", uri=True)
        try:
            return db.execute(sql, args).fetchall()
        except sqlite3.OperationalError:  # the schema is not there yet
            return []
        finally:
            db.close()

    def messages(self) -> list[tuple[str, str]]:
        return self.query("SELECT role, content FROM messages ORDER BY id")

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def close(self, timeout: float = PATIENCE_S) -> int:
        """Ctrl+Q, then waits for the exit (killing the process if it does not go)."""
        if self.process.poll() is None:
            try:
                self.write(b"\x11")
                self.process.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        return self.process.returncode
