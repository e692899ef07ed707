"""The format registry: one list of formats for the CLI, the engine, the readers and the docs; and
formats added from outside imgpack (an installed plugin, or register() at run time)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import pip_install

from imgpack import convert, formats, open_dataset
from imgpack.cli import main
from imgpack.errors import ManifestError, OptionError
from imgpack.formats import FormatOption, FormatSpec

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
TOY = Path(__file__).parent / "plugins" / "imgpack-toy"


def test_builtin_formats_in_order() -> None:
    assert formats.names()[: len(formats.BUILTIN)] == formats.BUILTIN
    assert formats.BUILTIN == ("pt", "lmdb", "hdf5", "tfrecord", "webdataset")
    for spec in formats.specs():
        assert spec.writer_class().__name__.endswith("Writer")
        assert spec.reader_class().format == spec.name


def test_unknown_format_is_refused_with_the_list() -> None:
    with pytest.raises(OptionError, match=r"unknown format 'zarr': expected one of pt, lmdb"):
        formats.get("zarr")


def test_importing_the_registry_loads_no_format_library() -> None:
    code = (
        "import sys, imgpack.formats as f, imgpack.options; f.names(); "
        "print(sorted(m for m in ('h5py', 'lmdb', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cli_takes_formats_and_options_from_the_registry() -> None:
    result = CliRunner().invoke(main, ["convert", "--help"], terminal_width=400)
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())
    for spec in formats.specs():
        assert spec.name in help_text
        for option in spec.options:
            assert f"{option.name} (default {option.default})" in help_text
    listed = CliRunner().invoke(main, ["formats"])
    assert listed.exit_code == 0
    for spec in formats.specs():
        assert listed.output.count(f"{spec.name}: ") == 1
        for option in spec.options:
            assert f"-o {option.name}=" in listed.output


def _doc_options(name: str) -> dict[str, str]:
    """The option table under '## Options' of docs/formats/<name>.md: name -> default."""
    text = (DOCS / "formats" / f"{name}.md").read_text(encoding="utf-8")
    section = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| `?([^`|]*?)`? \|", section, flags=re.M)
    return dict(rows)


@pytest.mark.parametrize("name", formats.BUILTIN)
def test_docs_option_tables_match_the_registry(name: str) -> None:
    spec = formats.get(name)
    assert _doc_options(name) == {o.name: str(o.default) for o in spec.options}
    assert f"formats/{name}.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_options_are_parsed_by_the_spec() -> None:
    spec = formats.get("hdf5")
    assert spec.check_options({"chunk_size": "2MiB"}) == {
        "compression": "none",
        "chunk_size": 2 << 20,
        "libver": "earliest",
    }
    with pytest.raises(OptionError, match=r"invalid compression 'zip': expected one of none"):
        spec.check_options({"compression": "zip"})
    with pytest.raises(OptionError, match=r"format 'hdf5' has no option prefix \(its options"):
        spec.check_options({"prefix": "x"})
    with pytest.raises(OptionError, match="invalid label_offset 'one'"):
        formats.get("tfrecord").check_options({"label_offset": "one"})


def _toy_spec(name: str) -> FormatSpec:
    return FormatSpec(
        name=name,
        writer="imgpack.formats.pt.writer:PTWriter",
        reader="imgpack.formats.pt.reader:PTDataset",
        summary="pt under another name",
        options=(FormatOption("level", "1", "a number", int),),
        sharded=True,
        default_shard_size=1 << 20,
    )


def test_register_at_run_time(uniform_folder: Path, tmp_path: Path) -> None:
    spec = formats.register(_toy_spec("pt2"))
    try:
        assert "pt2" in formats.names()
        with pytest.raises(ValueError, match="registered already"):
            formats.register(_toy_spec("pt2"))
        with pytest.raises(OptionError, match="invalid level 'x'"):
            convert(uniform_folder, tmp_path / "bad", "pt2", level="x", progress=False)
        manifest = convert(uniform_folder, tmp_path / "out", "pt2", level="3", progress=False)
        assert manifest.options["level"] == 3 and manifest.format == "pt2"
        # The manifest names pt2; the reader is the spec's (which checks its own format name).
        with pytest.raises(ManifestError, match="holds format 'pt2', not 'pt'"):
            open_dataset(tmp_path / "out")
    finally:
        formats.unregister(spec.name)
    with pytest.raises(ManifestError, match="format 'pt2' is not known to this imgpack"):
        open_dataset(tmp_path / "out")


def test_a_missing_dependency_names_the_extra() -> None:
    spec = FormatSpec(
        "needs",
        writer="x:Y",
        reader="x:Z",
        summary="",
        requires=("no_such_module_anywhere",),
        extra="needs",
    )
    with pytest.raises(OptionError, match=r"pip install 'imgpack\[needs\]'"):
        spec.writer_class()


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The toy plugin (tests/plugins/imgpack-toy), pip-installed into a folder of its own."""
    return pip_install(TOY, tmp_path_factory)


def test_installed_plugin_adds_a_format(
    toy_site: Path, uniform_folder: Path, tmp_path: Path
) -> None:
    """An installed package with an imgpack.formats entry point adds a format to the CLI and the
    readers, touching nothing in imgpack."""
    env = {**os.environ, "PYTHONPATH": str(toy_site)}
    imgpack_cli = [sys.executable, "-m", "imgpack.cli"]
    listed = subprocess.run(
        [*imgpack_cli, "formats"], env=env, capture_output=True, text=True, check=True
    )
    assert "toy: a toy format from a plugin" in listed.stdout
    assert "-o greeting=" in listed.stdout
    for encoding, extra in (("original", []), ("raw", ["--size", "8"])):
        out = tmp_path / encoding
        done = subprocess.run(
            [
                *(*imgpack_cli, "convert", str(uniform_folder), str(out), "--format", "toy"),
                *("-q", "--encoding", encoding, "-o", "greeting=hi", *extra),
            ],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        assert (out / "toy.txt").read_text() == "hi"
        code = (
            "import sys, torch; from imgpack import open_dataset; "
            f"ds = open_dataset({str(out)!r}); "
            "torch.save([ds[i] for i in range(len(ds))], sys.argv[1])"
        )
        saved = tmp_path / f"{encoding}.pt"
        subprocess.run([sys.executable, "-c", code, str(saved)], env=env, check=True)
        size = 8 if encoding == "raw" else None
        ref = tmp_path / f"ref-{encoding}"
        convert(uniform_folder, ref, "pt", encoding=encoding, size=size, progress=False)
        reference = open_dataset(ref)
        got = torch.load(saved, weights_only=True)
        assert len(got) == len(reference) == 60
        for k, (image, label) in enumerate(got):
            want, target = reference[k]
            assert label == target and torch.equal(image, want)


TOY_TOUR = """
import sys
from imgpack import convert, export, merge, verify
src, base = sys.argv[1], sys.argv[2]
convert(src, f"{base}/toy", "toy", progress=False)
report = verify(f"{base}/toy", deep=True)
assert report.ok, report.problems
export(f"{base}/toy", f"{base}/exported", progress=False)
for part in (0, 1):
    convert(src, f"{base}/p{part}", "toy", num_parts=2, part=part, progress=False)
merge([f"{base}/p0", f"{base}/p1"], f"{base}/merged", progress=False)
convert(f"{base}/merged", f"{base}/back", "pt", progress=False)
with open(f"{base}/toy/toy.bin", "r+b") as data:  # one byte of one record flipped
    data.seek(100)
    byte = data.read(1)
    data.seek(100)
    data.write(bytes([byte[0] ^ 0xFF]))
print(verify(f"{base}/toy").ok)
"""


def test_the_toy_reader_needs_only_records(
    toy_site: Path, uniform_folder: Path, tmp_path: Path
) -> None:
    """The toy plugin's reader implements only _records and _load_paths; verify, export, merge
    and converting from its output work through the base class."""
    env = {**os.environ, "PYTHONPATH": str(toy_site)}
    done = subprocess.run(
        [sys.executable, "-c", TOY_TOUR, str(uniform_folder), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"  # the damaged output is reported
    files = sorted(p.relative_to(uniform_folder) for p in uniform_folder.rglob("*.png"))
    for name in files:  # original PNGs: the export is the source tree, byte for byte
        assert (tmp_path / "exported" / name).read_bytes() == (uniform_folder / name).read_bytes()
    reference = open_dataset(convert_reference(uniform_folder, tmp_path / "ref"))
    back = open_dataset(tmp_path / "back")
    assert back.stored_paths() == reference.stored_paths() and back.targets == reference.targets
    for i in range(len(reference)):
        assert torch.equal(back[i][0], reference[i][0])


def convert_reference(folder: Path, out: Path) -> Path:
    convert(folder, out, "pt", progress=False)
    return out


def test_a_reader_without_records_is_refused() -> None:
    from imgpack.formats.dataset_base import ImageDataset

    class NoRecords(ImageDataset):
        format = "none"

    with pytest.raises(TypeError, match=r"abstract method.*_records"):
        NoRecords("anywhere")  # type: ignore[abstract]


def test_a_broken_plugin_does_not_break_imgpack(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "broken_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[imgpack.formats]\nbroken = no_such_module:SPEC\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run(
        [sys.executable, "-m", "imgpack.cli", "formats"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0
    assert "webdataset: " in done.stdout
    assert "format plugin 'broken'" in done.stderr and "not loaded" in done.stderr
