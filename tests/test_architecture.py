"""The package's shape: formats live in imgpack/formats/<name>/ and source kinds in
imgpack/sources/<name>/, every module sits in a layer and imports only point down, and there is
no import cycle, counting imports inside functions, under ``if TYPE_CHECKING:`` and a package's
edges to its own submodules. Read from the source with ast, so the rules hold for every module."""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from imgpack import formats, sources

PACKAGE = Path(__file__).resolve().parents[1] / "imgpack"

#: The package's layers, bottom first. A module may import modules of its own layer and of the
#: layers below (imports inside functions and under ``if TYPE_CHECKING:`` count); every module
#: must be in a layer, so a new one is placed on purpose. ``x`` names the module ``x``; ``x.*``
#: every module below the package ``x``.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # The data model and small utilities: they know nothing of images, formats or the engine.
    (
        "foundation",
        (
            "imgpack.errors",
            "imgpack.version",
            "imgpack.system",
            "imgpack.tensors",
            "imgpack.units",
            "imgpack.checksum",
            "imgpack.fields",
            "imgpack.scan",
            "imgpack.stats",
            "imgpack.manifest",
            "imgpack.publishing",
            "imgpack.handover",
            "imgpack.sample",
            "imgpack.registry",
        ),
    ),
    # The image policy, the decoders, and the image-folder scan (the read side's ImageFolder
    # baseline lists folders too).
    (
        "images",
        (
            "imgpack.jpegheader",
            "imgpack.images",
            "imgpack.stored",
            "imgpack.decoding",
            "imgpack.recipe",
            "imgpack._jpegregion",
            "imgpack._pixelsums",
            "imgpack._batchcopy",
            "imgpack.sources.folder.scan",
        ),
    ),
    # I/O below the formats: object storage split by job (imgpack.storage.*), the one route
    # that opens an output, a bucket source's listing (verify takes a bucket output's files as
    # they are through it), and what the engine knows of Hugging Face datasets (reading them
    # as SRC; writing them is exporting's).
    (
        "storage",
        (
            "imgpack.storage",
            "imgpack.storage.*",
            "imgpack.opening",
            "imgpack.sources.listing",
            "imgpack.hf",
        ),
    ),
    # The format registry (its specs name readers and writers, whose types it uses), and each
    # format's codec, writer and reader.
    ("formats", ("imgpack.formats", "imgpack.formats.*", "imgpack.converters")),
    # The read side: opening outputs, loading, verifying. It never imports the engine.
    (
        "reading",
        (
            "imgpack.readers",
            "imgpack.loading",
            "imgpack.loading.*",
            "imgpack.verification",
            "imgpack.preview",
        ),
    ),
    # What a conversion reads (source kinds) and how it runs (executors, options).
    ("sources", ("imgpack.sources", "imgpack.sources.*", "imgpack.executors", "imgpack.options")),
    # The conversion engine and the commands built on it.
    (
        "engine",
        (
            "imgpack.pipeline",
            "imgpack.direct",
            "imgpack.planning",
            "imgpack.merging",
            "imgpack.appending",
            "imgpack.exporting",
        ),
    ),
    # The command line, and the package's facade (imgpack.convert, ...: lazy imports of all).
    ("facade", ("imgpack.cli", "imgpack", "imgpack.__main__")),
)


def _layer(module: str) -> int:
    """The layer of ``module``: an exact name first, else the deepest ``x.*`` that holds it."""
    for rank, (_, names) in enumerate(LAYERS):
        if module in names:
            return rank
    best = (-1, -1)
    for rank, (_, names) in enumerate(LAYERS):
        for name in names:
            package = name.removesuffix(".*")
            if name.endswith(".*") and module.startswith(package + "."):
                best = max(best, (package.count("."), rank))
    if best[1] < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return best[1]


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(module: str, path: Path) -> set[str]:
    """The imgpack modules ``module`` imports, at the top, inside functions and under ``if
    TYPE_CHECKING:`` (an import for the type checker is still a dependency: a cycle there is
    two modules that cannot be read or split apart); ``from imgpack import x`` counts as
    imgpack.x."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    known = _modules()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("imgpack"))
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.startswith("imgpack")
        ):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in known else node.module)
    names.discard(module)
    return names


def test_every_format_is_a_package_of_its_own() -> None:
    for name in formats.BUILTIN:
        package = PACKAGE / "formats" / name
        assert (package / "__init__.py").is_file() and (package / "writer.py").is_file()
        assert (package / "reader.py").is_file()
        spec = formats.get(name)
        for target in (spec.writer, spec.reader):
            assert target.startswith(f"imgpack.formats.{name}."), target


def test_every_source_kind_is_a_package_of_its_own() -> None:
    for name in sources.BUILTIN:
        package = PACKAGE / "sources" / name
        assert (package / "__init__.py").is_file(), name
        assert sources.get(name).source.startswith(f"imgpack.sources.{name}."), name


@pytest.mark.parametrize("module", sorted(_modules()))
def test_imports_only_point_down(module: str) -> None:
    own = _layer(module)
    imported = _imports(module, _modules()[module])
    assert "imgpack" not in imported, f"{module} imports the package itself (an upward import)"
    upward = sorted(
        f"{other} ({LAYERS[_layer(other)][0]})" for other in imported if _layer(other) > own
    )
    assert not upward, f"{module} ({LAYERS[own][0]}) imports upward: {upward}"


def test_no_import_cycles() -> None:
    """No cycle, counting the imports inside functions (a cycle there still means two modules
    that cannot be understood, or split, apart)."""
    modules = _modules()
    graph = {m: _imports(m, p) & set(modules) for m, p in modules.items()}

    def visit(node: str, stack: list[str], done: set[str]) -> None:
        if node in stack:
            raise AssertionError(
                "import cycle: " + " -> ".join([*stack[stack.index(node) :], node])
            )
        if node in done:
            return
        for child in sorted(graph[node]):  # a package's edges to its own submodules count
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


def test_no_ctypes_memory_tricks() -> None:
    """No reader builds memory views by address (``from_address``, ``np.ctypeslib``,
    ``MAP_FIXED`` placements): a mapping whose owner unmaps or moves it is a crash, and after a
    fork a hang. ctypes stays for the two system calls Python has no wrapper for (prctl's
    PR_SET_PDEATHSIG, renameat2)."""
    tricks = ("from_address", "ctypeslib", "MAP_FIXED", "ctypes.cast", "c_void_p")
    found = [
        f"{path.relative_to(PACKAGE)}: {trick}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for trick in tricks
        if trick in path.read_text(encoding="utf-8")
    ]
    assert found == []


def test_no_read_gives_advice() -> None:
    """The advice on loader settings is the loader's, tune's and profile's (#56): no reader
    warns from inside a read (no PerformanceWarning below imgpack.loading)."""
    readers = [*(PACKAGE / "formats").rglob("*.py"), PACKAGE / "opening.py"]
    readers += (PACKAGE / "storage").rglob("*.py")
    found = [str(p.relative_to(PACKAGE)) for p in readers if "PerformanceWarning" in p.read_text()]
    assert found == []


#: The modules that may read a manifest or fetch an output besides the route
#: (imgpack.opening, built on imgpack.manifest and imgpack.storage.*), and why.
OPENERS_ALLOWED = {
    "pipeline.py": "a resumed upload reads the manifest of the build it made itself",
    "direct.py": "shard tasks read the manifest they publish to DST (receipts, resume)",
}


def test_one_route_opens_an_output() -> None:
    """One route opens an output (#56): imgpack.opening.open_output (and its manifest-only
    open_manifest). No reader, command or source reads a manifest or fetches an output
    itself; the engine reads only what it writes."""
    openers = ("read_manifest(", "read_remote_manifest(", "fetch_output(", "LazyOutput(")
    route = {PACKAGE / "opening.py", PACKAGE / "manifest.py", *(PACKAGE / "storage").rglob("*.py")}
    found = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path not in route and any(name in path.read_text() for name in openers)
    }
    assert sorted(found) == sorted(OPENERS_ALLOWED), found


def test_readers_are_built_from_what_they_opened() -> None:
    """Every reader's constructor takes what the route opened and one ReadOptions value; the
    path-taking conveniences are class methods that call the route."""
    from imgpack.formats.dataset_base import ImageDataset

    for name in formats.BUILTIN:
        reader = formats.get(name).reader_class()
        assert issubclass(reader, ImageDataset), name
        parameters = list(inspect.signature(reader.__init__).parameters)
        assert parameters[:3] == ["self", "opened", "options"], (name, parameters)


def test_no_reader_imports_a_writer() -> None:
    """A format's byte-level code is its codec's, which its writer and its reader import; a
    reader never imports a writer (#56: tfrecord's reader imported its writer for a codec)."""
    found = [
        str(path.relative_to(PACKAGE))
        for path in (PACKAGE / "formats").glob("*/reader.py")
        if re.search(r"^from imgpack\.formats\.\w+\.writer import", path.read_text(), re.M)
    ]
    assert found == []


#: Module-level state (a binding that changes while the program runs: a mutable container, a
#: lock, or a name rebound with ``global``), and why each is the process's rather than an
#: object's (#56). A new one is added here on purpose, with its reason, or made an object's.
STATE_ALLOWED = {
    "imgpack.checksum._label_table": "a lookup table built on first use, the same for all",
    "imgpack.decoding._pools": "one decode thread pool per size in a process (reset on fork)",
    "imgpack.decoding._pools_lock": "guards _pools (made again after a fork)",
    "imgpack.tensors._FORKED": "set after a fork: torch's threaded kernels may not run here",
    "imgpack.formats.lmdb.reader._environments": "LMDB allows one environment per file and "
    "process: readers of one output share it, counted",
    "imgpack.formats.lmdb.reader._environments_pid": "the process _environments belong to",
    "imgpack.handover._pools": "a worker process's shared-memory batch buffers",
    "imgpack.handover._pool_guard": "guards the buffers",
    "imgpack.handover._held_buffers": "the training process's views of workers' buffers",
    "imgpack.handover._held_pids": "the workers those buffers belong to",
    "imgpack.handover._held_lock": "guards them (pin-memory thread and main thread)",
    "imgpack.images._strict_lock": "Pillow's decompression-bomb setting is process-global",
    "imgpack.images._strict_users": "how many strict decodes are in progress",
    "imgpack.images._strict_saved": "Pillow's setting to restore",
    "imgpack.loading.advice._advised": "readers given the loader's note in this process (weak)",
    "imgpack.sources.base._run": "the conversion run a pool worker or Ray actor serves",
    "imgpack.sources.base._opened": "the sources that run's worker opened, dropped with it",
    "imgpack.storage.cache.stats": "what the cache did in this process, for tests and logs",
    "imgpack.storage.location._inherited": "a forked child's copies of the parent's filesystems, "
    "kept: collecting one would unregister the parent's sockets from their shared epoll",
    "imgpack.storage.location._forks": "forks this process made: a filesystem opened before "
    "one is not used after it",
    "imgpack.storage.lazy._filesystems": "the lazy readers' one client per store and options in "
    "this process (a new one after each fork)",
    "imgpack.storage.lazy._prefetchers": "this process's prefetchers (weak): paused while a "
    "DataLoader forks its workers",
    "imgpack.storage.cache._held": "the cache locks this process holds: a forked child closes "
    "its copies (a kept copy would hold the parent's lock forever)",
}

_MUTABLE_CALLS = {"dict", "list", "set", "OrderedDict", "defaultdict", "deque", "Lock", "RLock",
                  "WeakSet", "WeakKeyDictionary", "WeakValueDictionary", "CacheStats", "local"}  # fmt: skip


def _module_state() -> set[str]:
    found = set()
    for module, path in _modules().items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.update(f"{module}.{name}" for name in node.names)
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
                call = value.func if isinstance(value, ast.Call) else None
                name = getattr(call, "id", getattr(call, "attr", None))
                mutable = isinstance(value, ast.Dict | ast.List | ast.Set) or name in _MUTABLE_CALLS
                for target in targets:
                    if (
                        mutable
                        and isinstance(target, ast.Name)
                        and not target.id.isupper()  # a constant table, by convention
                        and not target.id.startswith("__")
                    ):
                        found.add(f"{module}.{target.id}")
    return found


def test_module_level_state_only_where_allowed() -> None:
    found = _module_state()
    assert sorted(found - set(STATE_ALLOWED)) == [], "module state without a reason"
    assert sorted(set(STATE_ALLOWED) - found) == [], "allowed state that is gone: remove it"
