"""The code's shape, checked from its own imports: no import circles, each engine layer imports only
from the layers below it (as engine/__init__.py lists them), nvchat's and its app's modules only from
their own layer and those below (as their __init__.py docstrings list them), the engine never reaches
the UI, and an import inside a function says why it is there (start-up time, or an optional package)."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "kernels", "nvchat", "themes", "benchmarks")
# Bottom to top, as engine/__init__.py's docstring lists them.
ENGINE_LAYERS = ("options", "core", "distributed", "layers", "models", "checkpoints", "text", "config", "runner",
                 "llm", "request_stream", "backend", "engine_thread")
# What an import inside a function must say about itself, on its line or in the comment above it.
REASON = re.compile(r"#.*\b(start-up|optional)\b", re.IGNORECASE)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = path
    return found


MODULES = modules()


def resolve(name: str) -> str | None:
    """The project module an import of `name` loads last (a package's attribute may be a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports(path: Path):
    """(line, imported module, at module level) for every import of a project module in the file."""
    tree = ast.parse(path.read_text(), str(path))
    this = module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    top_level = set()
    for node in tree.body:
        stack = [node]
        while stack:  # module level includes if/try blocks, not function or class bodies
            n = stack.pop()
            top_level.add(id(n))
            if isinstance(n, (ast.If, ast.Try)):
                stack += n.body + n.orelse + getattr(n, "handlers", []) + getattr(n, "finalbody", [])
            elif isinstance(n, ast.ExceptHandler):
                stack += n.body
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] if base else [a.name for a in node.names]
        for name in names:
            yield node.lineno, name, id(node) in top_level


def project_edges():
    for name, path in MODULES.items():
        for line, imported, top in imports(path):
            target = resolve(imported)
            if target is not None and target != name:
                yield name, target, line, top


def test_no_import_circles():
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for source, target, _, top in project_edges():
        if top:
            graph[source].add(target)
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import circles: {cycles}"


def engine_layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "engine" or len(parts) == 1:
        return None
    return ENGINE_LAYERS.index(parts[1])


def test_every_engine_module_sits_in_a_listed_layer():
    unlisted = [m for m in MODULES if m.startswith("engine.") and m.split(".")[1] not in ENGINE_LAYERS]
    assert not unlisted, f"engine modules outside the layers engine/__init__.py lists: {unlisted}"


def test_engine_layers_import_only_downwards():
    upward = []
    for source, target, line, _ in project_edges():
        s, t = engine_layer(source), engine_layer(target)
        if s is not None and t is not None and t > s:
            upward.append(f"{MODULES[source].relative_to(ROOT)}:{line} imports {target}")
    assert not upward, "imports running up the engine's layers:\n" + "\n".join(upward)


def test_the_engine_never_imports_the_app_and_kernels_never_import_the_engine():
    wrong = []
    for name, path in MODULES.items():
        for line, imported, _ in imports(path):
            root = imported.split(".")[0]
            if name.startswith("engine") and root in ("nvchat", "textual", "prompt_toolkit"):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
            if name.startswith("kernels") and root in ("engine", "nvchat"):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not wrong, "\n".join(wrong)


def declared_layers(package: str) -> list[set[str]]:
    """The layers a package's docstring lists after a line ending "bottom to top:", bottom first:
    each layer's modules on lines indented four spaces (a trailing comma continues them on the
    next), its description on lines indented further."""
    init = ROOT.joinpath(*package.split("."), "__init__.py")
    lines = ast.get_docstring(ast.parse(init.read_text())).splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith("bottom to top:")) + 1
    layers, continued = [], False
    for line in lines[start:]:
        if not line.strip():
            continue
        if not line.startswith("    "):
            break
        if line.startswith("     "):  # a description
            continue
        names = {name.strip() for name in line.strip().rstrip(",").split(",")}
        if continued:
            layers[-1] |= names
        else:
            layers.append(names)
        continued = line.rstrip().endswith(",")
    return layers


def package_layer(module: str, package: str, layers: list[set[str]]) -> int | None:
    """The layer of the package's module (a subpackage's modules sit in the subpackage's)."""
    if not module.startswith(package + "."):
        return None
    name = module[len(package) + 1:].split(".")[0]
    return next((i for i, layer in enumerate(layers) if name in layer), None)


LAYERED_PACKAGES = ("nvchat", "nvchat.app")


@pytest.mark.parametrize("package", LAYERED_PACKAGES)
def test_every_module_sits_in_a_layer_its_package_lists(package):
    layers = declared_layers(package)
    assert layers, f"{package}/__init__.py lists no layers"
    inside = {m[len(package) + 1:].split(".")[0] for m in MODULES if m.startswith(package + ".")}
    unlisted = sorted(inside - set().union(*layers))
    assert not unlisted, f"modules outside the layers {package}'s docstring lists: {unlisted}"
    missing = sorted(set().union(*layers) - inside)
    assert not missing, f"{package}'s docstring lists modules that do not exist: {missing}"


@pytest.mark.parametrize("package", LAYERED_PACKAGES)
def test_imports_run_only_down_the_layers_a_package_lists(package):
    layers = declared_layers(package)
    upward = []
    for source, target, line, _ in project_edges():
        s, t = package_layer(source, package, layers), package_layer(target, package, layers)
        if s is not None and t is not None and t > s:
            upward.append(f"{MODULES[source].relative_to(ROOT)}:{line} imports {target}")
    assert not upward, f"imports running up {package}'s layers:\n" + "\n".join(upward)


def function_import_runs(tree: ast.AST):
    """Runs of consecutive import statements inside functions, as lists of nodes."""
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            for body in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
                if not isinstance(body, list):
                    continue
                run = []
                for statement in body + [None]:
                    if isinstance(statement, (ast.Import, ast.ImportFrom)):
                        run.append(statement)
                    elif run:
                        yield run
                        run = []


@pytest.mark.parametrize("package", ["engine", "kernels", "nvchat", "themes", "benchmarks"])
def test_imports_inside_functions_say_why(package):
    """A run of imports in a function is explained by a comment on one of its lines or just above."""
    unexplained = []
    for path in sorted((ROOT / package).rglob("*.py")):
        lines = path.read_text().splitlines()
        for run in function_import_runs(ast.parse("\n".join(lines), str(path))):
            first, last = run[0].lineno, run[-1].end_lineno
            top = max(first - 2, 0)  # the line above, and the comment block above that
            while top > 0 and lines[top - 1].strip().startswith("#"):
                top -= 1
            text = lines[top:last]
            if not any(REASON.search(line) for line in text):
                unexplained.append(f"{path.relative_to(ROOT)}:{first}: {lines[first - 1].strip()}")
    assert not unexplained, ("imports inside functions with no comment saying why (start-up time or an "
                             "optional package):\n" + "\n".join(sorted(set(unexplained))))


def test_the_scheduling_core_loads_without_torch():
    import subprocess
    import sys
    code = ("import sys, engine.core.scheduler, engine.core.step_plan; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_the_command_line_and_the_backend_interface_load_without_torch():
    """`nvchat --help`, a bad flag, and a remote backend's modes need no torch (seconds to import)."""
    import subprocess
    import sys
    code = ("import sys, engine.options, engine.backend, nvchat.cli, nvchat.flags, nvchat.conversation, "
            "nvchat.remote_backend, nvchat.backend; sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
