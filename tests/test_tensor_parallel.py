"""Tensor parallelism on CPU over gloo: the same greedy tokens as one rank and as HF transformers,
several engines in one process, and no hang or leftover process whatever way a rank goes away.

The tiny checkpoints have 4 query heads and 2 KV heads, so TP=4 runs with KV heads replicated."""
import contextlib
import gc
import os
import signal
import subprocess
import sys
import threading
import traceback
import weakref
from pathlib import Path

import pytest

from engine import LLM, EngineThread, SamplingParams
from engine.runner.tp_runner import WorkerError
from tests.conftest import hf_greedy, random_prompts, save_tiny_hf_model
from tests.test_async_scheduling import completions, record_plans, run
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parent.parent
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# --- process and shared-memory bookkeeping -----------------------------------------------------------


def _children() -> set[int]:
    """Pids whose parent is this process, zombies included: an unreaped worker is a leak too."""
    try:
        import psutil
        return {p.pid for p in psutil.Process().children()}
    except ImportError:
        pass
    me, found = os.getpid(), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == me:
                found.add(int(entry))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for init to reap it: it has exited)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@contextlib.contextmanager
def leaves_nothing_behind():
    children, shm = _children(), _shm()
    yield
    assert _children() - children == set(), "processes left running"
    assert _shm() - shm == set(), "/dev/shm entries left behind"


# --- same tokens -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_one_rank_and_hf(tiny_qwen3, tp):
    prompts = random_prompts([1, 7, 16, 17, 33, 64], seed=tp)
    # Two that share the 64-token prompt's first 40 tokens, in the same call: its blocks, registered
    # as its step is scheduled, are theirs in that same step, on every rank.
    prompts += [prompts[-1][:40] + own for own in random_prompts([3, 9], seed=tp + 10)]
    expected = hf_greedy(tiny_qwen3, prompts, GREEDY.max_tokens)
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4) as llm:
        one_rank = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
    with leaves_nothing_behind():
        with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, tensor_parallel_size=tp) as llm:
            assert len(llm.runner.worker_pids) == tp - 1
            assert not llm.runner.fast_all_reduce  # gloo all the way on CPU
            qkv = llm.runner.runner.model.model.layers[0].self_attn.qkv_proj
            assert (qkv.num_heads, qkv.num_kv_heads, qkv.kv_replicas) == (4 // tp, 1, tp // 2)
            outs = [o["token_ids"] for o in llm.generate(prompts, GREEDY)]
            assert llm.stats().num_free_blocks == llm.stats().num_blocks
            assert llm.stats().prefix_hit_tokens == 2 * 40
    assert outs == one_rank == expected


def test_overlapped_steps_match_one_synchronous_rank(tiny_qwen3):
    """With the overlap (the default) a worker feeds each step's pending inputs from the tokens
    rank 0 broadcast the step before. Seeded and greedy rows, prompts chunked beside decodes, and
    preemption in a tight cache all give one synchronous rank's tokens."""
    prompts = random_prompts([30, 22, 41, 12, 27, 35], seed=23)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * 3 + \
             [SamplingParams(temperature=0.8, top_k=30, top_p=0.9, max_tokens=30, ignore_eos=True, seed=i)
              for i in range(3)]
    with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, async_scheduling=False) as one_rank:
        expected = completions(run(one_rank, prompts, params)[0])
    with leaves_nothing_behind():
        with LLM(tiny_qwen3, device="cpu", kvcache_block_size=4, num_kvcache_blocks=40, max_prefill_chunk=13,
                 tensor_parallel_size=2) as llm:
            assert llm.async_scheduling
            plans = record_plans(llm)
            got = completions(run(llm, prompts, params)[0])
            assert llm.stats().num_preemptions > 0
    assert any(p.feed_rows for p in plans)
    assert got == expected


@pytest.mark.parametrize("tp", [1, 2])
def test_an_engine_frees_its_model_when_it_ends(tiny_qwen3, tp):
    """The engine freezes its objects out of the garbage collector, so anything of the model's
    caught in a reference cycle would outlive it: on a GPU, a second engine then found no memory
    left (bench_tp, 32B shape). Rank 0's weights must go by reference counting alone."""
    llm = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=tp)
    rank0 = llm.runner.runner if tp > 1 else llm.runner
    weights = [weakref.ref(p) for p in rank0.model.parameters()]
    llm.generate(random_prompts([9], seed=5), GREEDY)
    llm.shutdown()
    del llm, rank0
    gc.collect()  # what bench_tp does between engines; frozen objects stay out of its reach
    assert not [w for w in weights if w() is not None]


def step_in_turn(engines: list[LLM], prompts, params=GREEDY) -> list[list[list[int]]]:
    """Each engine's completions of the prompts, with the engines stepped one after another."""
    seqs = [[llm.add_request(p, params) for p in prompts] for llm in engines]
    while any(llm.has_unfinished() for llm in engines):
        for llm in engines:
            if llm.has_unfinished():
                llm.step()
    return [[s.completion_token_ids for s in per_engine] for per_engine in seqs]


def test_two_engines_in_one_process(tiny_qwen3, tiny_qwen3_tied):
    """Each has its own store, group and workers; stepping them in turn must not cross wires.
    One also prefills in chunks beside decodes, one ends on an exception, one is shut down twice."""
    prompts = random_prompts([5, 40, 23], seed=11)
    expected = {p: hf_greedy(p, prompts, GREEDY.max_tokens) for p in (tiny_qwen3, tiny_qwen3_tied)}
    with leaves_nothing_behind():
        a = LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2, kvcache_block_size=8,
                max_num_batched_tokens=24, max_prefill_chunk=13)
        with pytest.raises(KeyError, match="on purpose"):
            with LLM(tiny_qwen3_tied, device="cpu", tensor_parallel_size=2) as b:
                assert not set(a.runner.worker_pids) & set(b.runner.worker_pids)
                assert step_in_turn([a, b], prompts) == [expected[tiny_qwen3], expected[tiny_qwen3_tied]]
                b_workers = b.runner.worker_pids
                raise KeyError("on purpose")
        assert not any(_running(pid) for pid in b_workers)
        # a is untouched by b's end
        assert [o["token_ids"] for o in a.generate(prompts[:1], GREEDY)] == expected[tiny_qwen3][:1]
        a.shutdown()
        a.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            a.generate(prompts[:1], GREEDY)


# --- failures ---------------------------------------------------------------------------------------------


def thread_stacks() -> str:
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"--- {names.get(ident, ident)}\n" + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())


def kill_worker_mid_decode(llm: LLM, pid: int, seq, timeout: float) -> WorkerError:
    """Steps llm on a thread until seq has decoded a few tokens, kills worker `pid`, and returns
    the WorkerError the stepping thread got, checking it names the killed rank."""
    outcome = {}

    def run():
        try:
            while llm.has_unfinished():
                llm.step()
        except BaseException as e:
            outcome["error"] = e

    stepper = threading.Thread(target=run, daemon=True)
    stepper.start()
    wait_until(lambda: seq.num_completion_tokens >= 3 or not stepper.is_alive(), timeout, "decoding to start")
    os.kill(pid, signal.SIGKILL)
    stepper.join(timeout=timeout)
    # Where each thread waits (the stepper, the TP monitor, a fast all-reduce's releaser) if it hangs.
    assert not stepper.is_alive(), f"the caller hung after its worker died; its threads:\n{thread_stacks()}"
    error = outcome.get("error")
    assert isinstance(error, WorkerError), f"expected a WorkerError, got {error!r}"
    assert f"rank 1 (pid {pid}) was killed by SIGKILL" in str(error)
    return error


def test_worker_killed_mid_run_raises_in_caller(tiny_qwen3):
    with leaves_nothing_behind():
        with LLM(tiny_qwen3, device="cpu", tensor_parallel_size=2) as llm:
            [pid] = llm.runner.worker_pids
            seq = llm.add_request(random_prompts([8])[0], SamplingParams(temperature=0, max_tokens=900,
                                                                         ignore_eos=True))
            error = kill_worker_mid_decode(llm, pid, seq, timeout=30)
            assert error.pids == [pid]
            assert llm.runner.broken
            with pytest.raises(RuntimeError, match="earlier failure"):
                llm.generate([[1, 2, 3]], GREEDY)


def test_worker_exception_carries_its_traceback(tmp_path):
    """A checkpoint whose q_proj holds rank 0's rows only: rank 0 loads fine, rank 1 raises."""
    from safetensors.torch import load_file, save_file

    save_tiny_hf_model(tmp_path, tie=False)
    weights = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.self_attn.q_proj.weight"
    weights[name] = weights[name][:32].contiguous()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with leaves_nothing_behind():
        with pytest.raises(WorkerError) as info:
            LLM(tmp_path, device="cpu", tensor_parallel_size=2)
    message = str(info.value)
    assert info.value.ranks == [1]
    assert message.startswith("tensor-parallel worker rank 1 (pid ")
    assert "Traceback (most recent call last)" in message
    assert "tp_worker.py" in message and "load_weights" in message
    assert "q_proj.weight: has 32 rows, need 64" in message


_PARENT = """
import sys, torch
torch.set_num_threads(1)
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", tensor_parallel_size=2)
print(*llm.runner.worker_pids, flush=True)
if sys.argv[2] == "killed":
    while True:
        llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
"""


@pytest.mark.parametrize("how", ["killed", "exits without shutdown"])
def test_workers_end_with_their_parent(tiny_qwen3, how):
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tiny_qwen3), how.split()[0]],
                              cwd=REPO, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 1, "the parent did not start its engine"
        if how == "killed":
            os.kill(parent.pid, signal.SIGKILL)
        assert parent.wait(timeout=60) == (-signal.SIGKILL if how == "killed" else 0)
        wait_until(lambda: not any(_running(pid) for pid in pids), 10, "the workers to exit")
    finally:
        parent.kill()
        parent.wait()


def test_engine_thread_reports_a_dead_worker_and_stays_responsive(tiny_qwen3):
    """What the chat app sees: open streams end with "error" naming the worker, and later
    submissions are refused with the reason instead of hanging."""
    with leaves_nothing_behind():
        with EngineThread(tiny_qwen3, device="cpu", tensor_parallel_size=2) as engine:
            [pid] = engine.llm.runner.worker_pids
            stream = engine.submit(random_prompts([8])[0], SamplingParams(temperature=0, max_tokens=900,
                                                                          ignore_eos=True))
            wait_until(lambda: stream.num_completion_tokens >= 3 or stream.finished, 30, "decoding to start")
            os.kill(pid, signal.SIGKILL)
            assert stream.wait(30), "the stream hung after its worker died"
            assert stream.finish_reason == "error" and f"pid {pid}" in stream.error
            with pytest.raises(RuntimeError, match="the engine has stopped"):
                engine.submit([1, 2, 3])
            assert engine.stats().num_running == 0
