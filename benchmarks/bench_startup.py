"""Start-up time, phase by phase: from process start to the first token of `nvchat -p` and to the
app's ready state (its first chat on screen), each run in a fresh process.

    python -m benchmarks.bench_startup [--mode pipe|app|both] [--runs 3] [--device cpu|cuda]
        [--model M] [--cold] [--importtime] [--baseline-tree DIR] [--json benchmarks/out/startup.json]

The phases come from timestamps nvchat writes when NVCHAT_STARTUP_TRACE names a file
(nvchat/startup_trace.py): its own marks and every stage the engine reports through its progress
callback, each one the start of a phase. The first phase runs from the moment this script starts
the process (interpreter start-up and nvchat.cli's imports); "importing the engine" is torch and
the engine's modules. On a GPU the engine's stages show its warm-up (Triton kernels compile on
their first launch, here or from Triton's cache), the CUDA-graph memory measurement, the captures
and the logits warm-up separately.

Peak RSS and CPU seconds are the child's own (os.wait4); the peak by the end of each phase is the
one the trace recorded at the next mark (VmHWM). The CPU time tells a loaded box's runs
apart from a slow start: on a shared machine compare CPU seconds as well as wall time.

--cold runs each start with an empty nvchat cache (XDG_CACHE_HOME: the GGUF index and tokenizer
are rebuilt) and an empty Triton cache (TRITON_CACHE_DIR), as on a fresh machine; without it the
caches are the user's, as on a second start. Triton's cache is TRITON_CACHE_DIR, else
~/.triton/cache; the runs report how many kernels they added to it (each a compile).
--baseline-tree runs the same starts from another checkout of nvchat, alternating with this one,
so both meet the same machine load. Without --cold each tree then gets an nvchat cache of its own,
filled by one start of each mode that is not recorded: some entries are keyed by the engine's code
and replace the entry of an older key (the CPU's quantized weights, engine/checkpoints/weight_cache.py),
so two trees on one cache undid each other's, and every start of either was a first one (2-core box:
2.9-3.2 s and 1 GB at its peak, against 1.3 s and 390 MB for one tree alone).

Before the runs each tree's packages are compiled to bytecode (their __pycache__, which git
ignores), as `pip install` does and as any start does where bytecode may be written: a second start
reads it. Where PYTHONDONTWRITEBYTECODE is set (some sandboxes and CI set it) every start would
otherwise compile nvchat's and the engine's ~70 modules from source, 0.10-0.21 s of a CPU pipe start
(their import time under python -X importtime, 0.17-0.28 s against 0.065-0.074, 2-core box).
Every run's wall time, CPU seconds and peak RSS are listed after the medians.
"""
import argparse
import compileall
import fcntl
import importlib.util
import os
import platform
import pty
import re
import select
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import termios
import time
from pathlib import Path

from benchmarks.common import print_table, write_json
from nvchat.startup_trace import TRACE_ENV, read

REPO = Path(__file__).resolve().parents[1]
# The packages a start imports from the tree (the rest comes from site-packages).
PACKAGES = ("nvchat", "engine", "kernels", "themes")
PROMPT = "Hi"
# Until the first token: the app's ready state, or pipe mode's first token.
TIMEOUT_S = 600


def triton_cache_dir(env: dict) -> Path:
    return Path(env.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _count_entries(path: Path) -> int:
    return sum(1 for _ in path.iterdir()) if path.is_dir() else 0


def phase_label(stage: str) -> str:
    """A stage's name without its counts ("capturing decode CUDA graphs (8/16)", "allocating the KV
    cache: 5825 blocks..."), so that a phase reported in several steps sums into one."""
    return re.sub(r"\s*\(\d+/\d+\)$", "", stage.split(":")[0]).strip()


# What runs after a mark, where the mark names a moment rather than a stage.
_AFTER = {"pipe": {"ready": "ready, to the first token (the prompt's prefill)", "first token": "first token, to the exit"},
          "app": {"ready": "ready, to the exit"}}


def phases(started: float, marks: list[tuple[float, str, int | None]], ended: float, mode: str = "pipe",
           final_peak_kb: int | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds in each phase: from the start to the first mark ("python and nvchat's imports"), from
    each mark to the next, and from the last mark to the exit; and the process's peak RSS in MB by
    the end of each phase (the next mark's, and final_peak_kb for the last), where the trace has it."""
    if not marks:
        return {"whole run (this tree writes no trace)": ended - started}, {}
    points = [(started, "python and nvchat's imports")] + [(t, _AFTER[mode].get(s, phase_label(s))) for t, s, _ in marks]
    traced_peaks = any(peak is not None for _, _, peak in marks)
    ends = [(t, peak) for t, _, peak in marks] + [(ended, final_peak_kb if traced_peaks else None)]
    seconds: dict[str, float] = {}
    peaks: dict[str, float] = {}
    for (t, label), (t_next, peak) in zip(points, ends):
        seconds[label] = seconds.get(label, 0.0) + max(t_next - t, 0.0)
        if peak is not None:
            peaks[label] = max(peaks.get(label, 0.0), peak / 1024)
    return seconds, peaks


def compile_bytecode(tree: Path) -> None:
    """Writes the tree's bytecode where it is missing or stale (see the module's doc)."""
    for package in PACKAGES:
        if (tree / package).is_dir() and not compileall.compile_dir(tree / package, quiet=1):
            raise RuntimeError(f"{tree / package} does not compile")


# What a pipe start imports, and with it the third-party packages whose bytecode it reads
# (transformers: a first start on a GGUF file builds its tokenizer).
_START_IMPORTS = ("nvchat.cli", "nvchat.pipe", "engine", "engine.runner.model_runner", "kernels.rmsnorm",
                  "engine.text.tokenizer", "gguf", "tokenizers", "jinja2", "transformers")
_LIST_PACKAGES = f"""
import importlib, sys, sysconfig
for name in {_START_IMPORTS!r}:
    try:
        importlib.import_module(name)
    except ImportError:
        pass
stdlib = sysconfig.get_paths()["stdlib"]
for module in list(sys.modules.values()):
    path = getattr(module, "__path__", None)
    if path and "." not in module.__name__ and module.__name__ not in {PACKAGES!r}:
        for folder in path:
            if not folder.startswith(stdlib) or "site-packages" in folder:
                print(folder)
"""


def dependency_folders(tree: Path) -> list[str]:
    """The folders of the third-party packages a pipe start imports from `tree`."""
    env = dict(os.environ, PYTHONPATH=_python_path(tree))
    out = subprocess.run([sys.executable, "-c", _LIST_PACKAGES], env=env, capture_output=True, text=True, check=True)
    return sorted(set(out.stdout.split()))


def missing_bytecode(folders: list[str]) -> list[str]:
    """The folders whose package's own __init__ has no current bytecode beside it."""
    missing = []
    for folder in folders:
        init = Path(folder) / "__init__.py"
        if init.exists() and not Path(importlib.util.cache_from_source(str(init))).exists():
            missing.append(folder)
    return missing


def _python_path(tree: Path) -> str:
    # The tree first; the rest of the path stays (packages installed beside the interpreter's own).
    return os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)


def _environment(tree: Path, cold_dir: Path | None, trace: Path, cache_home: Path | None = None) -> dict:
    env = dict(os.environ, PYTHONPATH=_python_path(tree), **{TRACE_ENV: str(trace)})
    env.pop("TEXTUAL", None)
    if cold_dir is not None:
        env["XDG_CACHE_HOME"] = str(cold_dir / "cache")
        env["TRITON_CACHE_DIR"] = str(cold_dir / "triton")
    elif cache_home is not None:
        env["XDG_CACHE_HOME"] = str(cache_home)
    return env


def _settings_dirs(env: dict, home: Path) -> None:
    # The app stores conversations: a scratch config and data directory keeps the user's apart.
    env["XDG_CONFIG_HOME"] = str(home / "config")
    env["XDG_DATA_HOME"] = str(home / "data")


def run_once(mode: str, tree: Path, nvchat_args: list[str], cold: bool, python_flags=(),
             cache_home: Path | None = None) -> dict:
    """One start in a fresh process; returns its marks, phases, peak RSS, CPU time and stderr.
    cache_home: the nvchat cache's XDG_CACHE_HOME for a warm start (default the user's)."""
    with tempfile.TemporaryDirectory(prefix="nvchat-startup-") as scratch:
        scratch = Path(scratch)
        trace = scratch / "trace.tsv"
        env = _environment(tree, scratch if cold else None, trace, cache_home)
        _settings_dirs(env, scratch)
        triton_dir = triton_cache_dir(env)
        kernels_before = _count_entries(triton_dir)
        command = [sys.executable, *python_flags, "-m", "nvchat.cli", *nvchat_args]
        started = time.time()
        if mode == "pipe":
            # stderr to a file: -X importtime's lines would fill a pipe nobody reads until the end.
            with open(scratch / "stderr", "wb") as err:
                process = subprocess.Popen([*command, "-p", PROMPT, "--max-tokens", "1"], env=env, cwd=scratch,
                                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err)
                first_output = _first_output(process)
                _, status, usage = os.wait4(process.pid, 0)
            ended = time.time()
            stderr = (scratch / "stderr").read_text(errors="replace")
        else:
            first_output = None
            status, usage, ended, stderr = _run_app(command, env, scratch, trace)
        marks = read(trace) if trace.exists() else []
        kernels_added = _count_entries(triton_dir) - kernels_before if not cold else _count_entries(triton_dir)
    code = os.waitstatus_to_exitcode(status)
    goal = "first token" if mode == "pipe" else "ready"
    # A tree without the trace (a baseline from before it) still shows pipe mode's first token on stdout.
    reached = next((t for t, s, _ in marks if s == goal), first_output)
    if reached is None:
        raise RuntimeError(f"{mode} start (exit {code}) never reached {goal!r}:\n{stderr[-3000:]}")
    seconds, peaks = phases(started, marks, ended, mode, final_peak_kb=usage.ru_maxrss)
    return {"to_goal_s": reached - started, "phases": seconds, "phase_peak_rss_mb": peaks, "exit_code": code,
            "peak_rss_mb": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
            "triton_kernels_added": kernels_added, "stderr": stderr}


def _first_output(process: subprocess.Popen) -> float | None:
    """When the process first wrote to its stdout (pipe mode's first token); reads it to the end."""
    first = None
    while os.read(process.stdout.fileno(), 65536):
        if first is None:
            first = time.time()
    process.stdout.close()
    return first


def _run_app(command: list[str], env: dict, cwd: Path, trace: Path):
    """The app on a pseudo-terminal until its trace says "ready", then SIGTERM (which quits as Ctrl+Q)."""
    env["TERM"] = "xterm-256color"
    fd, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    process = subprocess.Popen(command, stdin=child, stdout=child, stderr=child, env=env, cwd=cwd,
                               start_new_session=True)
    os.close(child)
    output = bytearray()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if trace.exists() and any(s == "ready" for _, s, _ in read(trace)):
                break
            # The app draws to its terminal: keep reading it, or it blocks on a full buffer.
            try:
                if select.select([fd], [], [], 0.02)[0]:
                    output += os.read(fd, 65536)
            except OSError:
                break
        ended = time.time()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
        _, status, usage = os.wait4(process.pid, 0)
    finally:
        os.close(fd)
    return status, usage, ended, output.decode(errors="replace")[-3000:]


def import_times(tree: Path, nvchat_args: list[str]) -> list[tuple[str, float]]:
    """Seconds of each top-level package's imports (python -X importtime, cumulative) in one pipe start."""
    result = run_once("pipe", tree, nvchat_args, cold=False, python_flags=("-X", "importtime"))
    totals: dict[str, float] = {}
    for line in result["stderr"].splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m and not m.group(2).startswith(" "):  # a top-level import: its cumulative time is all of it
            package = m.group(2).strip().split(".")[0]
            totals[package] = totals.get(package, 0.0) + int(m.group(1)) / 1e6
    return sorted(totals.items(), key=lambda kv: -kv[1])


def _summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def report(name: str, runs: list[dict]) -> dict:
    labels = []
    for r in runs:
        labels += [label for label in r["phases"] if label not in labels]
    def peak(label: str) -> str:
        values = [r["phase_peak_rss_mb"][label] for r in runs if label in r["phase_peak_rss_mb"]]
        return f"{statistics.median(values):.0f}" if values else ""

    rows = [(label, _summary([r["phases"].get(label, 0.0) for r in runs]), peak(label)) for label in labels]
    rows += [("= to the goal (wall)", _summary([r["to_goal_s"] for r in runs]), ""),
             ("  CPU seconds, whole run", _summary([r["cpu_s"] for r in runs]), ""),
             ("  peak RSS, MB", _summary([r["peak_rss_mb"] for r in runs]), ""),
             ("  Triton kernels compiled", _summary([float(r["triton_kernels_added"]) for r in runs]), "")]
    print(f"\n{name}: {len(runs)} runs, median (range)")
    print_table(rows, ("phase", "seconds", "peak RSS by its end, MB"))
    print_table([(str(i), f"{r['to_goal_s']:.2f}", f"{r['cpu_s']:.2f}", f"{r['peak_rss_mb']:.0f}")
                 for i, r in enumerate(runs, 1)], ("run", "to the goal, s", "CPU s", "peak RSS, MB"))
    return {"runs": [{k: v for k, v in r.items() if k != "stderr"} for r in runs]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("pipe", "app", "both"), default="both")
    p.add_argument("--runs", type=int, default=3, help="starts of each mode (and tree), alternating")
    p.add_argument("--model", help="as nvchat's --model (default: nvchat's default model)")
    p.add_argument("--device", help="as nvchat's --device")
    p.add_argument("--cold", action="store_true", help="empty nvchat and Triton caches for every start")
    p.add_argument("--importtime", action="store_true", help="also one pipe start under python -X importtime")
    p.add_argument("--baseline-tree", help="another nvchat checkout to alternate with, for a before/after")
    p.add_argument("--extra", default="", help="more nvchat flags, e.g. \"--quantization none\"")
    p.add_argument("--compile-dependencies", action="store_true",
                   help="first write the bytecode that the third-party packages a start imports lack, as pip "
                        "install does (machines whose Python packages were installed without it)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    nvchat_args = [*(["--model", args.model] if args.model else []), *(["--device", args.device] if args.device else []),
                   *args.extra.split()]
    modes = ["pipe", "app"] if args.mode == "both" else [args.mode]
    trees = {"this tree": REPO}
    if args.baseline_tree:
        trees["baseline"] = Path(args.baseline_tree).resolve()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    print(f"{platform.node()}  {cpu}  {os.cpu_count()} cores  load {os.getloadavg()[0]:.1f}  "
          f"nvchat {' '.join(nvchat_args) or '(defaults)'}  {'cold' if args.cold else 'warm'} caches  "
          f"Triton cache {'(fresh per run)' if args.cold else triton_cache_dir(dict(os.environ))}")
    for tree in trees.values():
        compile_bytecode(tree)
    folders = dependency_folders(REPO)
    if args.compile_dependencies:
        for folder in folders:
            compileall.compile_dir(folder, quiet=1, workers=0)
    without = missing_bytecode(folders)
    if without:
        print(f"WARNING: no bytecode for {', '.join(Path(f).name for f in without)}: every start compiles them from "
              "source (seconds for torch), which a pip-installed package does not; --compile-dependencies writes it")
    cache_homes = {tree_name: None for tree_name in trees}  # None: the user's cache
    caches_root = Path(tempfile.mkdtemp(prefix="nvchat-startup-caches-")) if len(trees) > 1 and not args.cold else None
    results: dict[str, list[dict]] = {f"{tree} / {mode}": [] for tree in trees for mode in modes}
    try:
        if caches_root is not None:
            for tree_name, tree in trees.items():
                cache_homes[tree_name] = caches_root / tree_name.replace(" ", "-")
                for mode in modes:  # not recorded: it fills the tree's own cache
                    run_once(mode, tree, nvchat_args, False, cache_home=cache_homes[tree_name])
            print("each tree started once per mode first, unrecorded, with an nvchat cache of its own")
        for _ in range(args.runs):  # alternating, so every tree and mode meets the same machine load
            for tree_name, tree in trees.items():
                for mode in modes:
                    results[f"{tree_name} / {mode}"].append(
                        run_once(mode, tree, nvchat_args, args.cold, cache_home=cache_homes[tree_name]))
    finally:
        if caches_root is not None:
            shutil.rmtree(caches_root, ignore_errors=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    payload = {"nvchat_args": nvchat_args, "cold": args.cold, "cpu": cpu, "cores": os.cpu_count()}
    for name, runs in results.items():
        payload[name] = report(name, runs)
    if args.importtime:
        times = import_times(REPO, nvchat_args)
        print("\nimports of one pipe start by top-level package (python -X importtime, cumulative; its own "
              "overhead included)")
        print_table([(name, f"{s:.2f}") for name, s in times[:15]], ("package", "seconds"))
        payload["import_times"] = times
    write_json(args.json, payload)


if __name__ == "__main__":
    main()
