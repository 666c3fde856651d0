"""The package's folders are its layers: imports run one way (down), no module imports itself back through others,
modules stay small, and the command line stays thin."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "skipsearch"
# From the bottom up: a module imports its own layer and the layers below it, never one above.
LAYERS = ("constants", "io", "decode", "costs", "search", "report", "api", "cli", "__init__", "__main__")
# Imports inside functions are for what `--help` must not load (torch, transformers, optuna): they live in the
# command line, and in io/data.py, whose builtin prompts the parser reads without torch.
LAZY_IMPORTERS = ("cli", "io.data")


def modules():
    """{dotted name under skipsearch: path}, a package as its __init__."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _type_checking(node):
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == "TYPE_CHECKING"


def _imports(node, in_function=False):
    """(import node, whether it runs inside a function) under `node`, leaving out `if TYPE_CHECKING:` blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _type_checking(child):
            for other in child.orelse:
                yield from _imports(other, in_function)
            continue
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, inner
        yield from _imports(child, inner)


def imports():
    """{module: {imported module: whether only inside functions}} among skipsearch's modules."""
    known = modules()
    graph = {}
    for name, path in known.items():
        package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
        edges = graph.setdefault(name, {})
        for node, in_function in _imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name.removeprefix("skipsearch.") for a in node.names if a.name.startswith("skipsearch.")]
            elif node.level:
                base = package[: len(package) - node.level + 1] + ([node.module] if node.module else [])
                targets = [".".join(base)] + [".".join(base + [a.name]) for a in node.names]
            elif node.module and node.module.startswith("skipsearch."):
                base = node.module.removeprefix("skipsearch.")
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                targets = []
            for target in targets:
                if target in known and target != name:
                    edges[target] = edges.get(target, True) and in_function
    return graph


def layer(name):
    return LAYERS.index(name.split(".")[0])


def test_the_package_has_subpackages():
    subpackages = [p for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()]
    assert len(subpackages) >= 3
    assert {p.name for p in subpackages} <= set(LAYERS), "a new folder needs its place among LAYERS"


def test_no_import_cycle_counting_imports_inside_functions():
    graph, state, path = imports(), {}, []

    def visit(module):
        state[module] = "open"
        path.append(module)
        for target in graph.get(module, ()):
            assert state.get(target) != "open", " -> ".join(path[path.index(target):] + [target])
            if target not in state:
                visit(target)
        path.pop()
        state[module] = "done"

    for module in graph:
        if module not in state:
            visit(module)


def test_imports_point_down_the_layers():
    upward = [f"{a} -> {b}" for a, targets in imports().items() for b in targets if layer(b) > layer(a)]
    assert not upward


def test_imports_inside_functions_only_keep_help_light():
    lazy = [f"{a} -> {b}" for a, targets in imports().items() for b, inside in targets.items()
            if inside and not a.startswith(LAZY_IMPORTERS)]
    assert not lazy


def test_no_module_is_over_450_lines():
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert not {name: lines for name, lines in sizes.items() if lines > 450}


def test_the_command_line_is_at_most_a_tenth_of_the_package():
    lines = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    command_line = sum(n for name, n in lines.items() if name.split(".")[0] == "cli")
    assert command_line <= 0.1 * sum(lines.values())


def test_the_ci_scripts_name_modules_that_exist():
    """.ci's shell scripts import skipsearch's modules by path, where no import checker sees them: a module that
    moved would break CI's install check, not a test."""
    import importlib
    import re

    scripts = (PACKAGE.parent / ".ci").iterdir()
    named = {m for script in scripts for m in re.findall(
        r"(?:from|import) (skipsearch(?:\.\w+)*)", script.read_text())}
    assert named  # the scripts do import the package: a check of nothing would pass
    for name in sorted(named):
        importlib.import_module(name)


def test_check_releases_refuses_what_is_no_release_before_making_a_venv(tmp_path):
    """A typo (`--help`, a flag, two releases) is refused in one line with exit code 2, not a venv installed for
    minutes and then a pip error about `transformers==--help`."""
    import shutil
    import subprocess

    ci = tmp_path / ".ci"
    ci.mkdir()
    shutil.copy(PACKAGE.parent / ".ci" / "check-releases", ci)  # run from a copy: its venvs land in tmp_path
    for arguments in (["--help"], ["5.25.0", "6.0.0"], ["torch==latest"]):
        run = subprocess.run(["bash", str(ci / "check-releases"), *arguments], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 2 and len(run.stderr.splitlines()) == 1 and "expected one release" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ci"]


def test_each_pytest_xdist_worker_and_its_processes_take_a_share_of_the_cores():
    """conftest's `pytest_configure`: two workers each running torch's default thread count on 2 cores made a study
    test 4x slower than alone. Only a run under several pytest-xdist workers (the README's test command) checks it."""
    import subprocess
    import sys

    import pytest
    import torch
    from conftest import worker_threads

    threads = worker_threads()
    if threads is None:
        pytest.skip("not run by several pytest-xdist workers")
    assert torch.get_num_threads() == threads
    started = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, check=True)
    assert int(started.stdout) == threads


def test_the_readmes_layout_table_names_every_module():
    """A reader finds a module's job in README's Layout table; the command line's are named by their commands."""
    readme = (PACKAGE.parent / "README.md").read_text()
    table = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    named = {name for name, path in modules().items() if path.name != "__init__.py" and "." in name
             and not name.startswith("cli.")}
    assert named, "no module found"
    assert {name for name in named if f"`{name.rsplit('.', 1)[1]}.py`" not in table} == set()
