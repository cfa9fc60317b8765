"""One tensor-parallel rank (1..N-1) of an engine, in a process of its own.

TensorParallelRunner starts it as `python -m engine.runner.tp_worker FD PARENT_PID`, FD being this end of
a socket pair to rank 0. The worker builds the very same ModelRunner rank 0 builds and then runs
each call rank 0 runs, in the same order, so the collectives inside them line up.

Messages on the socket are pickles of plain data, from rank 0 only:
  rank 0 -> worker: the start-up dict, then (method, args, wants_reply) per call, None to stop
  worker -> rank 0: ("ok", result) after start-up and after calls that want a reply,
                    ("error", traceback text, collective) once, just before exiting
A worker exits on any error (the ranks' collectives no longer line up after one), when rank 0
closes the socket, and when rank 0's process dies, even in the middle of a collective.
"""
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

_ORPHAN_CHECK_S = 0.2
_MAX_TRACEBACK_CHARS = 32_000  # a socket buffer's worth: sending it must never block


def _exit_when_orphaned(parent_pid: int) -> None:
    # The socket's EOF covers a worker waiting for its next call; this covers one stuck in a
    # collective or a CUDA sync when rank 0's process is killed.
    while os.getppid() == parent_pid:
        time.sleep(_ORPHAN_CHECK_S)
    os._exit(3)


def _serve(conn: Connection) -> None:
    # start-up: the orphan watch runs before torch's seconds-long import, so a worker whose
    # parent dies meanwhile still exits
    import torch
    import torch.distributed as dist

    from engine.distributed import collectives
    from engine.runner.model_runner import ModelRunner

    start = conn.recv()
    config, rank = start["config"], start["rank"]
    if config.device.type == "cuda":
        device = torch.device("cuda", (config.device.index or 0) + rank)
        torch.cuda.set_device(device)  # before the group, so NCCL makes no context on cuda:0
    else:
        device = config.device
        torch.set_num_threads(start["num_threads"])
    store = dist.TCPStore(start["host"], start["port"], is_master=False, timeout=start["timeout"])
    group = collectives.create_group(rank, config.tensor_parallel_size, store, device, start["timeout"])
    runner = ModelRunner(config, rank, tp_group=group)
    conn.send(("ok", runner.num_blocks))
    while True:
        call = pickle.loads(conn.recv_bytes())
        if call is None:
            return
        method, args, wants_reply = call
        result = getattr(runner, method)(*args)
        if wants_reply:
            conn.send(("ok", result))


def main() -> None:
    conn = Connection(int(sys.argv[1]))
    threading.Thread(target=_exit_when_orphaned, args=(int(sys.argv[2]),), daemon=True).start()
    # Ctrl-C in a terminal reaches the whole process group; rank 0 decides what it means.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = 0
    try:
        _serve(conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        code = 2  # rank 0 has gone; there is no one left to tell
    except BaseException as e:
        text = traceback.format_exc()
        if len(text) > _MAX_TRACEBACK_CHARS:
            text = text[:2_000] + "\n[...]\n" + text[-(_MAX_TRACEBACK_CHARS - 2_000):]
        try:
            conn.send(("error", text, type(e).__name__ == "CollectiveError"))
        except OSError:
            pass
        code = 1
    # _exit: interpreter teardown could block on a communicator whose peers are gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
