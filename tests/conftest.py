import getpass
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# The suite never writes the user's own directories: tests make random GGUF files and checkpoints
# by the hundred, and the engine keeps an index, a tokenizer or weights for each under
# $XDG_CACHE_HOME/nvchat. Caches go to one directory per user that outlives the run, as the real one
# does (a rerun reuses SmolLM2's converted tokenizer); settings and conversations to a fresh one.
# Tests that need their own directories still set them (tests/app/conftest.py: per test).
try:
    _USER = getpass.getuser()
except (KeyError, OSError):  # a uid with no name (some containers)
    _USER = str(os.getuid())
os.environ["XDG_CACHE_HOME"] = str(Path(tempfile.gettempdir()) / f"nvchat-test-cache-{_USER}")
_RUN_DIR = Path(tempfile.mkdtemp(prefix="nvchat-test-run-"))
os.environ["XDG_CONFIG_HOME"] = str(_RUN_DIR / "config")
os.environ["XDG_DATA_HOME"] = str(_RUN_DIR / "data")

# Without a GPU, Triton kernels run in its interpreter; it must be chosen before any kernel is
# defined, so before the first `import kernels.*`.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite runs on CPU; keep it from fighting the 2-core CI box with oversubscribed threads.
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True)
def fresh_random_seed() -> int:
    """Every test draws fresh random inputs, from a seed that pytest shows with a failure (the
    test's captured output), so a rare failure can be replayed: random.seed and torch.manual_seed
    with it. Without it a test's inputs would depend on which tests ran before it."""
    value = random.SystemRandom().randrange(2**31)
    random.seed(value)
    torch.manual_seed(value)
    print(f"torch seed {value}")
    return value


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_RUN_DIR, ignore_errors=True)


def save_tiny_hf_model(path, *, tie: bool, arch: str = "qwen3", seed: int = 0, **overrides):
    """A tiny random checkpoint written by transformers' own save_pretrained: the oracle's model."""
    import transformers

    shape = dict(vocab_size=211, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                 tie_word_embeddings=tie, initializer_range=0.2)
    if arch in ("qwen3", "qwen3_moe"):
        shape["head_dim"] = 16
    if arch == "qwen3_moe":  # 8 experts of 32 columns, 2 chosen a token
        shape.update(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
    shape.update(overrides)
    config_cls, model_cls = {
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**shape)).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-untied")
    save_tiny_hf_model(path, tie=False)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_tied(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-tied")
    save_tiny_hf_model(path, tie=True, seed=1)
    return path


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE whose router renormalizes its top-2 (norm_topk_prob, as Qwen3-30B-A3B's)."""
    path = tmp_path_factory.mktemp("tiny-qwen3-moe")
    save_tiny_hf_model(path, tie=False, arch="qwen3_moe", seed=2)
    return path


@pytest.fixture(scope="session")
def demo_model_path(tmp_path_factory):
    from engine.checkpoints.demo_model import ensure_demo_model
    return ensure_demo_model(tmp_path_factory.mktemp("cache"))


INJECTED_FAULT = "injected fault"


def fail_next_launch(llm) -> None:
    """llm's next launch raises RuntimeError(INJECTED_FAULT), once: it puts back the execute it
    replaced (a test's spy included) before raising."""
    execute = llm.runner.execute

    def fail(plan):
        llm.runner.execute = execute
        raise RuntimeError(INJECTED_FAULT)
    llm.runner.execute = fail


def random_prompts(lengths, vocab=211, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def hf_greedy(path, prompts, max_new_tokens, **load_kwargs):
    """HF transformers' own greedy completions, one prompt at a time (no padding in play).
    load_kwargs go to from_pretrained (gguf_file=... loads a GGUF file, dequantized by HF)."""
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load_kwargs).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 pad_token_id=0, eos_token_id=None)
            outs.append(gen[0, len(p):].tolist())
    return outs


# The tests' own MCP server (tests/mcp_test_server.py) over stdio, as config.toml's mcp_servers names one.
MCP_TEST_SERVER = {"test": {"command": sys.executable, "args": [str(Path(__file__).parent / "mcp_test_server.py")]}}


def force_tool_calls(monkeypatch, name: str, rounds: int) -> None:
    """The first `rounds` replies of each turn call the tool `name`, the engine's structured output
    holding the model to the call; later replies may call tools or not ("auto")."""
    from nvchat.conversation import Conversation

    def tool_choice(self, round_index):
        return {"type": "function", "function": {"name": name}} if round_index < rounds else "auto"
    monkeypatch.setattr(Conversation, "tool_choice", tool_choice)
