"""The commit each benchmark's JSON names (benchmarks/common.py): HEAD, marked "+wt" when the
tracked files differ from it, as on a GPU machine whose copied tree came with a stale .git."""
import subprocess

import pytest

from benchmarks import common


def git(where, *args):
    return subprocess.run(["git", *args], cwd=where, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "tracked.py").write_text("x = 1\n")
    git(tmp_path, "add", "tracked.py")
    git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    return tmp_path


def test_a_clean_tree_is_its_head(repo):
    (repo / "untracked.json").write_text("{}")  # benchmark output: not the code that ran
    assert common._git_commit(repo) == git(repo, "rev-parse", "--short", "HEAD")


def test_a_tree_that_differs_from_head_is_marked(repo):
    (repo / "tracked.py").write_text("x = 2\n")
    assert common._git_commit(repo) == git(repo, "rev-parse", "--short", "HEAD") + "+wt"


def test_outside_git_there_is_no_commit(tmp_path):
    assert common._git_commit(tmp_path) == ""


def test_nvchat_commit_names_the_run(monkeypatch, repo):
    monkeypatch.setenv("NVCHAT_COMMIT", "abc1234+wt")
    assert common.environment()["commit"] == "abc1234+wt"
    monkeypatch.delenv("NVCHAT_COMMIT")
    assert common.environment()["commit"] == common._git_commit(common.Path(common.__file__).parent)
