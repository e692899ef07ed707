"""Every file under SRC is accounted for (#55): converted, skipped (named, with why) or ignored
(named, with why), never dropped without a word; the dry run says what the run does."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import jpeg_bytes, png_bytes, smooth_rgb
from PIL import Image

from imgpack.cli import main
from imgpack.manifest import read_manifest
from imgpack.pipeline import dry_run
from imgpack.readers import open_dataset


def rgb(seed: int = 0) -> Image.Image:
    return Image.fromarray(smooth_rgb(np.random.default_rng(seed), 12, 16))


def every_shape(root: Path) -> dict[str, str]:
    """A tree with a file of every kind at every depth; what each should become."""
    expect: dict[str, str] = {}

    def put(rel: str, data: bytes, what: str) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        expect[rel] = what

    for i, name in enumerate(["cat", "dog"]):
        put(f"{name}/a.png", png_bytes(rgb(seed=i)), "converted")
        put(f"{name}/deep/er/b.jpg", jpeg_bytes(rgb(seed=10 + i)), "converted")
        put(f"{name}/notes.txt", b"text", "ignored")
        put(f"{name}/.hidden.png", png_bytes(rgb()), "ignored")
        put(f"{name}/zero.jpg", b"", "skipped")
    put("stray.jpg", jpeg_bytes(rgb(seed=3)), "skipped")  # beside the class folders
    put("README.md", b"about", "ignored")
    put(".DS_Store", b"x", "ignored")
    put(".thumbs/t.png", png_bytes(rgb()), "ignored")  # a hidden folder: ignored whole
    expect[".thumbs"] = expect.pop(".thumbs/t.png")
    os.symlink(root / "cat" / "a.png", root / "dog" / "link.png")
    expect["dog/link.png"] = "converted"
    os.symlink(root / "nowhere.png", root / "dog" / "dangling.png")
    expect["dog/dangling.png"] = "skipped"
    os.symlink(root / "cat", root / "cat" / "deep" / "loop")
    expect["cat/deep/loop"] = "ignored"
    if hasattr(os, "mkfifo"):
        os.mkfifo(root / "cat" / "pipe.jpg")
        expect["cat/pipe.jpg"] = "skipped"
    return expect


def files_under(root: Path) -> set[str]:
    """Every file and link under ``root``, hidden folders as one entry (``.thumbs/``)."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = Path(dirpath).relative_to(root)
        for d in list(dirnames):
            path = rel / d
            if d.startswith(".") or (root / path).is_symlink():
                found.add(path.as_posix())
                dirnames.remove(d)
        found.update((rel / f).as_posix() for f in filenames)
    return found


def test_converted_skipped_and_ignored_are_every_file_by_name(tmp_path: Path) -> None:
    src = tmp_path / "src"
    expect = every_shape(src)
    assert files_under(src) == set(expect)
    out = tmp_path / "out"
    planned = dry_run(src, out, "pt", on_error="skip")
    done = CliRunner().invoke(
        main, ["convert", str(src), str(out), "--format", "pt", "-q", "--on-error", "skip"]
    )
    assert done.exit_code == 0, done.output
    manifest = read_manifest(out)
    converted = {Path(p).relative_to(src).as_posix() for p, _ in open_dataset(out).samples}
    skipped = {s["path"] for s in manifest.skipped}
    ignored = {e["path"].rstrip("/") for e in planned.ignored}
    assert converted | skipped | ignored == set(expect)
    assert not (converted & skipped) and not (converted & ignored) and not (skipped & ignored)
    assert {p: w for p, w in expect.items() if w == "converted"}.keys() == converted
    assert {p for p, w in expect.items() if w == "skipped"} == skipped
    # the dry run skips what the run skips, and counts what it ignores
    assert {s["path"] for s in planned.skipped} == skipped
    assert manifest.source["ignored_files"] == len(ignored) == planned.ignored_files
    assert sum(manifest.source["ignored"].values()) == len(ignored)
    assert f"{len(skipped)} skipped" in done.output
    assert "skipped stray.jpg: an image beside the class folders" in done.output
    assert f"{len(ignored)} other file(s) ignored" in done.output
    info = CliRunner().invoke(main, ["info", str(out)])
    assert f"ignored:   {len(ignored)} other file(s) ignored (" in info.output
    assert "hidden" in info.output and "not an image file" in info.output


def test_images_beside_class_folders_are_refused_by_name(tmp_path: Path) -> None:
    src = tmp_path / "beach"
    for i in range(3):
        (src / "sub").mkdir(parents=True, exist_ok=True)
        (src / f"top{i}.jpg").write_bytes(jpeg_bytes(rgb(seed=i)))
        (src / "sub" / f"s{i}.jpg").write_bytes(jpeg_bytes(rgb(seed=9 + i)))
    for args in (["--dry-run"], []):
        done = CliRunner().invoke(
            main, ["convert", str(src), str(tmp_path / "o"), "--format", "pt", *args]
        )
        assert done.exit_code == 1
        line = done.output.strip().splitlines()[-1]
        assert "top0.jpg: an image beside the class folders, in no class" in line
        assert "--no-labels" in line and "(and 2 more)" in line
        assert not (tmp_path / "o").exists()
    done = CliRunner().invoke(
        main, ["convert", str(src), str(tmp_path / "o"), "--format", "pt", "--no-labels"]
    )
    assert done.exit_code == 0, done.output
    assert len(open_dataset(tmp_path / "o")) == 6


def test_the_dry_run_refuses_what_the_run_refuses_without_reading(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "ok.png").write_bytes(png_bytes(rgb()))
    os.symlink(src / "gone.png", src / "a" / "dangling.png")
    for args in (["--dry-run"], []):
        done = CliRunner().invoke(
            main, ["convert", str(src), str(tmp_path / "o"), "--format", "pt", *args]
        )
        assert done.exit_code == 1
        assert "a/dangling.png: a broken symbolic link" in done.output
    done = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "o"), "--format", "pt", "--on-error",
                                     "skip", "--dry-run"])  # fmt: skip
    assert done.exit_code == 0 and "skipped a/dangling.png: a broken symbolic link" in done.output


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_image_is_named_by_the_dry_run(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "ok.png").write_bytes(png_bytes(rgb()))
    (src / "a" / "locked.png").write_bytes(png_bytes(rgb()))
    (src / "a" / "locked.png").chmod(0)
    planned = dry_run(src, tmp_path / "o", "pt", on_error="skip")
    assert planned.skipped == [
        {"path": "a/locked.png", "reason": "cannot be read: permission denied"}
    ]


def test_a_bucket_folders_stray_images_are_refused(tmp_path: Path) -> None:
    """The listing's top-level objects are judged as the local walk judges files there."""
    from imgpack.sources.folder.scan import IGNORED_HIDDEN, IGNORED_OUTSIDE, scan_listing

    objects = {
        "cat": [("cat/a.png", 10, "e1")],
        "dog": [("dog/b.png", 10, "e2"), ("dog/.x", 1, "")],
    }
    top = [("stray.png", 5, "e3"), ("notes.txt", 1, "e4")]
    scan = scan_listing("s3://b/src", ["cat", "dog"], lambda name: objects[name], None, top)
    assert [s.path for s in scan.samples] == ["cat/a.png", "dog/b.png"]
    assert [u["path"] for u in scan.unreadable] == ["stray.png"]
    assert scan.ignored_reasons() == {IGNORED_HIDDEN: 1, IGNORED_OUTSIDE: 1}
