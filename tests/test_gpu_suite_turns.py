"""tests/gpu/conftest.py's turns, on CPU: under pytest-xdist a `whole_gpu` test runs while no other
test of the run does, the other tests run side by side, and whole-GPU tests are collected last.

A suite of its own in a temporary directory takes tests/gpu/conftest.py's hooks and runs in two
processes; each test writes when it began and ended, and the spans are compared."""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist")
REPO = Path(__file__).resolve().parent.parent

CONFTEST = """
from tests.gpu.conftest import pytest_collection_modifyitems, pytest_runtest_protocol  # noqa: F401
"""

TESTS = """
import json, os, time
import pytest

def _span(name):
    began = time.monotonic()
    time.sleep(0.2)  # long enough for the other process's test to start inside it
    with open(os.environ["SPANS"], "a") as f:
        f.write(json.dumps([name, began, time.monotonic()]) + "\\n")

@pytest.mark.whole_gpu
@pytest.mark.parametrize("i", range(3))
def test_whole(i):
    _span(f"whole-{i}")

@pytest.mark.whole_gpu
@pytest.mark.skipif(True, reason="decided at import, as the two-GPU tests' are on one GPU")
def test_whole_skipped():
    pass

@pytest.mark.parametrize("i", range(12))
def test_shared(i):
    _span(f"shared-{i}")
"""


def test_whole_gpu_tests_run_alone_and_the_others_side_by_side(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_turns.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    whole_gpu: alone\n")
    spans = tmp_path / "spans.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPANS": str(spans)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "15 passed, 1 skipped" in run.stdout
    rows = [json.loads(line) for line in spans.read_text().splitlines()]
    overlapping = lambda a, b: a[1] < b[2] and b[1] < a[2]  # noqa: E731
    for whole in (r for r in rows if r[0].startswith("whole")):
        assert not [r[0] for r in rows if r is not whole and overlapping(whole, r)], whole[0]
    shared = [r for r in rows if r[0].startswith("shared")]
    assert any(overlapping(a, b) for a in shared for b in shared if a is not b), "the two processes never ran at once"


def test_whole_gpu_tests_are_collected_last_in_their_order(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_turns.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    whole_gpu: alone\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                         timeout=300)
    names = [line.split("::")[1] for line in run.stdout.splitlines() if "::" in line]
    assert names == [f"test_shared[{i}]" for i in range(12)] + [f"test_whole[{i}]" for i in range(3)] + \
        ["test_whole_skipped"], run.stdout[-2000:]


TWO_GPU_TESTS = """
import pytest

@pytest.mark.whole_gpu
@pytest.mark.two_gpus
def test_on_two_gpus():
    pass

def test_on_one_gpu():
    pass
"""


def test_two_gpu_tests_are_skipped_under_xdist_with_the_command_that_runs_them(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_two.py").write_text(textwrap.dedent(TWO_GPU_TESTS))
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    whole_gpu: alone\n    two_gpus: two\n")
    # Not the xdist worker's variables of a suite that itself runs under xdist: the conftest reads them.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}, "PYTHONPATH": str(REPO)}

    def pytest_run(*args):
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args,
                               str(tmp_path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    shared = pytest_run("-n", "2")
    assert shared.returncode == 0, shared.stdout[-2000:] + shared.stderr[-2000:]
    assert "1 passed, 1 skipped" in shared.stdout
    assert "-p no:xdist -m two_gpus tests/gpu" in shared.stdout
    alone = pytest_run("-p", "no:xdist", "-m", "two_gpus")
    assert alone.returncode == 0 and "1 passed, 1 deselected" in alone.stdout, alone.stdout[-2000:]
