"""Tensor parallelism over processes: rank 0 runs in the caller's process, ranks 1..N-1 each in a
worker process (engine/runner/tp_worker.py) that builds the same ModelRunner and mirrors rank 0's calls.

Control channel: one socket pair per worker, inherited at spawn, carrying pickled plain data (the
engine config, step plans, tracebacks; never weights). Nothing is named or fixed: the rendezvous
store listens on a port the OS picks, and no shared-memory segment is created, so any number of
engines can run on one host, or in one process.

Failures end the group, since after one the ranks' collectives no longer line up:
- a worker that raises sends its traceback and exits; the caller gets a WorkerError carrying it;
- a worker that dies stops rank 0 too: gloo errors as soon as the dead rank's sockets close, and
  for NCCL a monitor thread aborts rank 0's communicator so kernels waiting on the dead peer end;
  either way the caller gets a WorkerError naming the worker;
- when rank 0's process dies, workers read EOF on their socket or see their parent pid change,
  and exit.
Workers are stopped by shutdown(), by a failure, when the runner is garbage collected, and at
interpreter exit, whichever comes first.
"""
import dataclasses
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.step_plan import StepPlan
from engine.distributed import collectives
from engine.runner.model_runner import ModelRunner

# Backstop for rendezvous and collectives; dead workers are noticed long before it.
_TIMEOUT = timedelta(minutes=10)
_STOP_GRACE_S = 10.0  # for workers to exit once told to, before they are killed
_REPORT_GRACE_S = 2.0  # for a failed worker's report once rank 0 has seen a collective fail
_SETTLE_S = 0.3  # after the first failed worker, for the rest of a cascade to come in
_POLL_S = 0.05
_HOST = "127.0.0.1"
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed or died. The message names each worker involved and carries
    the traceback of each one that could send it."""

    def __init__(self, message: str, ranks: list[int], pids: list[int]):
        super().__init__(message)
        self.ranks, self.pids = ranks, pids


class _WorkerFailed(Exception):
    """Internal: a worker reported an error or is gone; the workers themselves say which."""


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # readable once the process exits: wakes the monitor at once
    except (AttributeError, OSError):
        return None


def _send(w: "_Worker", payload: bytes) -> None:
    try:
        w.conn.send_bytes(payload)
    except OSError:
        raise _WorkerFailed() from None  # it has gone; what it left behind says why


class _Worker:
    def __init__(self, rank: int):
        self.rank = rank
        self.traceback: str | None = None
        self.collective = False  # its error was a collective failing, i.e. the echo of another's
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        try:
            with theirs:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "engine.runner.tp_worker", str(theirs.fileno()), str(os.getpid())],
                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        except BaseException:
            ours.close()
            raise
        self.pid = self.proc.pid
        self.conn = Connection(ours.detach())
        self.sentinel = _pidfd(self.pid)

    def has_failed(self) -> bool:
        """Reads whatever the worker has sent, without waiting; True once it has reported an error
        or exited."""
        try:
            while self.conn.poll():
                message = self.conn.recv()
                if message[0] == "error":
                    self.traceback, self.collective = message[1], message[2]
        except (EOFError, OSError):
            pass
        return self.traceback is not None or self.proc.poll() is not None

    def describe(self) -> str:
        who = f"tensor-parallel worker rank {self.rank} (pid {self.pid})"
        if self.traceback:
            return f"{who} failed: {self.traceback.strip().splitlines()[-1]}\n\nWorker traceback:\n{self.traceback}"
        code = self.proc.poll()
        if code is None:
            return f"{who} stopped responding"
        if code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with status {code}"
        return f"{who} {how} without reporting an error (its stderr may say more)"

    def close(self) -> None:
        self.conn.close()
        if self.sentinel is not None:
            os.close(self.sentinel)
            self.sentinel = None


class _Ranks:
    """Everything that must be released however the runner ends: the workers, their sockets, the
    group and the store. Apart from the runner, so that the finalizer and the monitor thread that
    hold it don't keep the runner alive."""

    def __init__(self):
        self.workers: list[_Worker] = []
        self.group: collectives.TPGroup | None = None
        self.store = None
        self.lost: _Worker | None = None  # set by the monitor: a worker that exited unasked
        self.aborted = False  # the monitor aborted rank 0's communicator
        self._stopping = False
        self._released = False
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()

    def start_monitor(self) -> None:
        self._monitor = threading.Thread(target=self._watch, name="nvchat-tp-monitor", daemon=True)
        self._monitor.start()

    def _watch(self) -> None:
        fds = [self._wake_r] + [w.sentinel for w in self.workers if w.sentinel is not None]
        timeout = _POLL_S if any(w.sentinel is None for w in self.workers) else None
        while not self._stopping:
            wait(fds, timeout)
            dead = next((w for w in self.workers if w.proc.poll() is not None), None)
            if dead is None or self._stopping:
                continue
            self.lost = dead
            group = self.group
            if group is not None and group.is_nccl:
                self.aborted = True
                group.abort()
            return

    def release(self, grace: float) -> None:
        """Stops the workers, asking first when grace > 0, killing any still running after it."""
        if self._released:
            return
        self._released = True
        self._stopping = True
        os.write(self._wake_w, b"x")
        # Before any worker exits or its pidfd closes, so the monitor takes neither for a failure.
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join()
        os.close(self._wake_r)
        os.close(self._wake_w)
        if grace > 0:
            stop = pickle.dumps(None)
            for w in self.workers:
                try:
                    w.conn.send_bytes(stop)
                except OSError:
                    pass
            deadline = time.monotonic() + grace
            for w in self.workers:
                try:
                    w.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
            w.close()
        if self.group is not None:
            self.group.destroy()
        self.group = self.store = None


class _GroupTokens:
    """Rank 0's sampled tokens for a step queued on every rank. A worker that dies while the step
    runs has its communicator aborted under it, which ends the step's kernels early with garbage in
    them: those tokens must never reach a user, so tolist() raises the failure instead."""

    def __init__(self, tokens, runner: "TensorParallelRunner"):
        self._tokens, self._runner = tokens, runner

    def tolist(self) -> list[int]:
        values = self._tokens.tolist()
        self._runner._check_usable()
        if self._runner._ranks.aborted:
            self._runner._fail(None)
        return values

    def logprobs(self):
        return self._tokens.logprobs()


class TensorParallelRunner:
    """ModelRunner's interface (num_blocks, execute) over tensor_parallel_size ranks, plus
    shutdown() and `broken`, which is True once a failure has ended the group."""

    def __init__(self, config: EngineConfig, progress=None):
        progress = progress or (lambda message: None)
        self.config = config
        self.size = config.tensor_parallel_size
        self.runner: ModelRunner | None = None  # rank 0's
        self.num_blocks = 0
        self.broken = False
        self._closed = False
        self._failure: str | None = None
        # (kind, hash) -> the ranks' reports of a disk operation, until every rank has made one.
        self._io_reports: dict[tuple, list[tuple]] = {}
        self._ranks = _Ranks()
        # Runs at shutdown(), when the runner is collected, or at interpreter exit, whichever is first.
        self._finalizer = weakref.finalize(self, self._ranks.release, _STOP_GRACE_S)
        try:
            self._start(progress)
        except BaseException as e:
            self._fail(e)

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._ranks.workers]

    @property
    def fast_all_reduce(self) -> bool:
        """Whether small all-reduces go over NVLink peer memory (engine/distributed/symm_allreduce.py), not NCCL."""
        group = self._ranks.group
        return group is not None and group.fast is not None

    def _start(self, progress) -> None:
        c, ranks = self.config, self._ranks
        device = torch.device("cuda", c.device.index or 0) if c.device.type == "cuda" else c.device
        if device.type == "cuda" and torch.cuda.device_count() < device.index + self.size:
            raise ValueError(f"tensor_parallel_size={self.size} from {device} needs GPUs {device.index}.."
                             f"{device.index + self.size - 1}, but {torch.cuda.device_count()} are visible")
        ranks.store = dist.TCPStore(_HOST, 0, world_size=self.size, is_master=True, wait_for_workers=False,
                                    timeout=_TIMEOUT)
        progress(f"starting {self.size - 1} tensor-parallel worker process{'es' if self.size > 2 else ''}")
        start = {"config": c, "host": _HOST, "port": ranks.store.port, "timeout": _TIMEOUT,
                 "num_threads": max(1, torch.get_num_threads() // self.size)}
        for rank in range(1, self.size):
            ranks.workers.append(_Worker(rank))
            _send(ranks.workers[-1], pickle.dumps({**start, "rank": rank}))
        ranks.group = self._join_group(device)
        ranks.start_monitor()
        self.runner = ModelRunner(c, 0, progress=progress, tp_group=ranks.group)
        for w in ranks.workers:
            if self._reply(w) != self.runner.num_blocks:
                raise RuntimeError(f"worker rank {w.rank} sized a different KV cache than rank 0")
        self.num_blocks = self.runner.num_blocks

    def _join_group(self, device: torch.device) -> collectives.TPGroup:
        """Rank 0's side of the rendezvous, on a helper thread, so that a worker that fails before
        reaching it (an import error, a bad config) raises here at once instead of after the
        timeout. A rendezvous abandoned that way ends at that timeout."""
        box = {}

        def join():
            try:
                box["group"] = collectives.create_group(0, self.size, self._ranks.store, device, _TIMEOUT)
            except BaseException as e:
                box["error"] = e

        thread = threading.Thread(target=join, name="nvchat-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            if thread.is_alive() and any(w.has_failed() for w in self._ranks.workers):
                raise _WorkerFailed()
        if "error" in box:
            raise box["error"]
        return box["group"]

    def _reply(self, w: _Worker):
        while not w.conn.poll(_POLL_S):
            # A worker stuck behind a dead peer (NCCL) never answers: give up once one is lost.
            if w.proc.poll() is not None or self._ranks.lost is not None:
                raise _WorkerFailed()
        try:
            message = w.conn.recv()
        except EOFError:
            raise _WorkerFailed() from None
        if message[0] == "error":
            w.traceback, w.collective = message[1], message[2]
            raise _WorkerFailed()
        return message[1]

    # --- running calls on every rank -------------------------------------------------------------

    def execute(self, plan: StepPlan) -> "_GroupTokens | None":
        # No reply is awaited: the collectives inside keep the ranks in step, and a worker that
        # fails exits, which fails rank 0's next collective. That keeps a round trip off every step.
        # Workers don't sample, so the sampling params and contexts, the slowest part to unpickle,
        # stay here.
        tokens = self._run("execute", (plan,), wants_reply=False,
                           worker_args=(dataclasses.replace(plan, sample_params=[], sample_contexts=[]),))
        return None if plan.defer_sampling else _GroupTokens(tokens, self)

    def mask_rows(self, count: int, words: int) -> None:
        """Rank 0 samples with the eager Sampler: its masks may come in any tensor."""
        return None

    def sample_deferred(self, masks) -> "_GroupTokens":
        """ModelRunner.sample_deferred on every rank: workers join the tokens' broadcast."""
        return _GroupTokens(self._run("sample_deferred", (masks,), wants_reply=False, worker_args=(None,)), self)

    def call(self, method: str, *args):
        """Runs ModelRunner.<method>(*args) on every rank, waits for all, returns rank 0's result."""
        return self._run(method, args, wants_reply=True)[0]

    def _run(self, method: str, args: tuple, wants_reply: bool, worker_args: tuple | None = None):
        """Runs the method on every rank; returns rank 0's result, or with wants_reply every rank's."""
        self._check_usable()
        payload = pickle.dumps((method, args if worker_args is None else worker_args, wants_reply),
                               pickle.HIGHEST_PROTOCOL)
        try:
            for w in self._ranks.workers:
                _send(w, payload)
            result = getattr(self.runner, method)(*args)
            if wants_reply:
                result = [result] + [self._reply(w) for w in self._ranks.workers]
        except BaseException as e:
            self._fail(e)
        if self._ranks.aborted:
            self._fail(None)  # NCCL was aborted under this call: its result cannot be trusted
        return result

    # --- the KV cache's lower tiers: every rank copies its own shard ----------------------------------

    @property
    def host_slots(self) -> int:
        return self.runner.host_slots

    def host_slots_allocated(self) -> int:
        return self.runner.host_slots_allocated()

    def grow_host_pool(self) -> tuple[int, bool]:
        """Every rank pins its next piece (the ranks' pools are alike): rank 0's answer."""
        return self._run("grow_host_pool", (), wants_reply=True)[0]

    def transfer(self, kv) -> None:
        self._run("transfer", (kv,), wants_reply=False)

    def loads_done(self) -> int:
        """Rank 0's view: a hint for scheduling. Every rank's step waits for its own loads."""
        self._check_usable()
        return self.runner.loads_done()

    def disk_files(self) -> list[tuple[int, int, float]]:
        """Rank 0's files; a block another rank lacks fails its fetch, and is computed."""
        self._check_usable()
        return self.runner.disk_files()

    def poll_tier_io(self) -> list[tuple]:
        """Disk operations every rank has ended: ok where each rank's was, bytes summed."""
        for rank_results in self._run("poll_tier_io", (), wants_reply=True):
            for result in rank_results:
                self._io_reports.setdefault(result[:2], []).append(result)
        done = []
        for key in [k for k, reports in self._io_reports.items() if len(reports) == self.size]:
            reports = self._io_reports.pop(key)
            ok = all(r[2] for r in reports)
            done.append((*key, ok, sum(r[3] for r in reports)) if key[0] == "written" else (*key, ok))
        return done

    def wait_tier_io(self, timeout: float) -> None:
        self._check_usable()
        self.runner.wait_tier_io(timeout)

    def drain_tier_io(self) -> None:
        self.call("drain_tier_io")

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this tensor-parallel runner has been shut down")
        if self.broken:
            raise RuntimeError(f"tensor parallelism stopped after an earlier failure: {self._failure}")
        if self._ranks.lost is not None:
            self._fail(None)

    # --- failure and shutdown ----------------------------------------------------------------------

    def _fail(self, error: BaseException | None):
        """Ends the group and raises: a WorkerError when a worker caused the failure, else `error`."""
        ranks = self._ranks
        from_workers = (error is None or isinstance(error, (_WorkerFailed, collectives.CollectiveError))
                        or ranks.aborted)
        failed = self._failed_workers(_REPORT_GRACE_S if from_workers else 0.0)
        self.broken = True
        self.runner = None
        ranks.release(grace=0.0)  # the survivors may be stuck in collectives: no use asking
        if not from_workers:
            self._failure = f"{type(error).__name__}: {error}"
            raise error
        if failed:
            failed.sort(key=lambda w: (w.collective, w.rank))  # the cause first, its echoes after
            err = WorkerError("\n\n".join(w.describe() for w in failed),
                              [w.rank for w in failed], [w.pid for w in failed])
        else:
            err = WorkerError("a tensor-parallel collective failed, but no worker reported why", [], [])
        self._failure = str(err).split("\n", 1)[0]
        raise err from (None if error is None or isinstance(error, _WorkerFailed) else error)

    def _failed_workers(self, grace: float) -> list[_Worker]:
        workers = self._ranks.workers
        deadline = time.monotonic() + grace
        settling = False
        while True:
            failed = [w for w in workers if w.has_failed()]
            if failed and not settling:
                settling, deadline = True, min(deadline, time.monotonic() + _SETTLE_S)
            left = deadline - time.monotonic()
            if len(failed) == len(workers) or left <= 0:
                return failed
            wait([w.conn for w in workers if w not in failed], min(left, _POLL_S))

    def shutdown(self) -> None:
        """Stops the workers and frees every rank's model. Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self.runner is not None:
            self.runner.shutdown()
        self.runner = None
        self._finalizer()
