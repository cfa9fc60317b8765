"""Waiting in tests for a state, not for a time."""
import time


def wait_until(condition, timeout: float, what: str, interval: float = 0.02):
    """Calls condition() until it returns something true, and returns that; fails the test after
    timeout seconds. For a state another thread or process reaches and nothing signals: interval is
    how often it looks, not a wait for anything."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return value
