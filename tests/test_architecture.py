"""The package's shape: formats live in imgpack/formats/<name>/, imports only point down, and
there is no import cycle. Read from the source with ast, so the rules hold for every module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from imgpack import formats

PACKAGE = Path(__file__).resolve().parents[1] / "imgpack"

#: What each part may not import (a prefix matches the module and everything below it).
FORBIDDEN = {
    # The data model and the small utilities know nothing of formats or the engine.
    "imgpack.manifest": (
        "imgpack.formats",
        "imgpack.converters",
        "imgpack.readers",
        "imgpack.pipeline",
    ),
    "imgpack.errors": ("imgpack.",),
    "imgpack.units": ("imgpack.formats", "imgpack.pipeline"),
    "imgpack.system": ("imgpack.",),
    "imgpack.version": ("imgpack.",),
    "imgpack.images": ("imgpack.formats", "imgpack.pipeline", "imgpack.manifest"),
    # Formats sit below the engine, the options, the facades, the loading side and the CLI.
    "imgpack.formats": (
        "imgpack.pipeline",
        "imgpack.executors",
        "imgpack.options",
        "imgpack.cli",
        "imgpack.loading",
        "imgpack.converters",
        "imgpack.readers",
    ),
    # The read side never imports the conversion engine.
    "imgpack.readers": ("imgpack.pipeline", "imgpack.executors", "imgpack.options", "imgpack.cli"),
    "imgpack.loading": ("imgpack.pipeline", "imgpack.executors", "imgpack.options", "imgpack.cli"),
    "imgpack.executors": ("imgpack.pipeline", "imgpack.formats", "imgpack.cli"),
    "imgpack.options": ("imgpack.pipeline", "imgpack.cli"),
    "imgpack.pipeline": ("imgpack.cli", "imgpack.loading", "imgpack.readers"),
    # Publishing and locking sit beside the manifest: both sides use them.
    "imgpack.publishing": (
        "imgpack.formats",
        "imgpack.pipeline",
        "imgpack.executors",
        "imgpack.options",
        "imgpack.readers",
        "imgpack.loading",
        "imgpack.cli",
    ),
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path, top_level_only: bool) -> set[str]:
    """The imgpack modules ``module`` imports (``from imgpack import x`` counts as imgpack.x).
    ``top_level_only`` leaves out imports inside functions and ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    nodes: list[ast.AST] = []
    if top_level_only:
        nodes = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    else:
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    names: set[str] = set()
    known = _modules()
    for node in nodes:
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("imgpack"))
        elif node.module and node.module.startswith("imgpack") and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
    return names


def test_every_format_is_a_package_of_its_own() -> None:
    for name in formats.BUILTIN:
        package = PACKAGE / "formats" / name
        assert (package / "__init__.py").is_file() and (package / "writer.py").is_file()
        assert (package / "reader.py").is_file()
        spec = formats.get(name)
        for target in (spec.writer, spec.reader):
            assert target.startswith(f"imgpack.formats.{name}."), target


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_only_point_down(module: str) -> None:
    rules = [
        bad for part, bad in FORBIDDEN.items() if module == part or module.startswith(part + ".")
    ]
    imported = _imports(module, _modules()[module], top_level_only=False)
    assert "imgpack" not in imported, f"{module} imports the package itself (an upward import)"
    for forbidden in (f for group in rules for f in group):
        offenders = sorted(
            i for i in imported if i == forbidden.rstrip(".") or i.startswith(forbidden)
        )
        assert not offenders, f"{module} imports {offenders}"


def test_no_import_cycles() -> None:
    modules = _modules()
    graph = {m: _imports(m, p, top_level_only=True) & set(modules) for m, p in modules.items()}

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            raise AssertionError(
                "import cycle: " + " -> ".join([*stack[stack.index(node) :], node])
            )
        if node in done:
            return
        for child in sorted(graph[node]):
            # A package's __init__ importing its own submodule is not a cycle through it.
            if child.startswith(node + "."):
                continue
            visit(child, [*stack, node], done)
        done.add(node)

    done: set[str] = set()
    for module in sorted(graph):
        visit(module, [], done)


def test_converting_a_folder_loads_no_torch(tmp_path: Path) -> None:
    """torch takes ~2 s to import: a conversion to a format that does not write torch files
    (every one but pt) never pays it, nor does the CLI before it knows the command."""
    import subprocess
    import sys

    from imgpack.sample import make_sample_folder

    make_sample_folder(tmp_path / "images", 12, 2, 0)
    code = (
        "import sys; from imgpack.cli import main\n"
        "try:\n    main(['convert', 'images', 'out', '--format', 'lmdb', '-q'])\n"
        "except SystemExit as exc:\n    assert not exc.code, exc.code\n"
        "print('torch' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "False", done.stderr
