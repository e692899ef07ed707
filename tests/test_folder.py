from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import FakeFolder, build_uniform_folder

from imgpack import convert
from imgpack.errors import ScanError
from imgpack.sources.folder.scan import read_class_list, scan_folder


def test_scan_finds_every_image_in_torchvision_order(edge_folder: FakeFolder) -> None:
    scan = scan_folder(edge_folder.root)
    assert scan.classes == edge_folder.classes
    assert [(s.path, s.label) for s in scan.samples] == edge_folder.images
    assert {e["path"]: e["reason"].split(" ")[0] for e in scan.ignored} == {
        ".hidden_class/": "hidden",
        "cat/.cache/": "hidden",
        "cat/.hidden.png": "hidden",
        "cat/notes.txt": "not",
        "cat/nested/loop/": "a",
    }
    assert scan.ignored_files == 5
    assert scan.empty_classes == ["dog_empty"]


def test_hidden_files_and_folders_are_ignored(edge_folder: FakeFolder) -> None:
    paths = [s.path for s in scan_folder(edge_folder.root).samples]
    assert not any("/." in p or p.startswith(".") for p in paths)
    assert ".hidden_class" not in scan_folder(edge_folder.root).classes


def test_symlinks_are_followed_without_looping(edge_folder: FakeFolder) -> None:
    paths = [s.path for s in scan_folder(edge_folder.root).samples]
    assert "cat/linked.png" in paths
    assert not any("/loop/" in p for p in paths)


def test_empty_class_keeps_its_label_and_warns(
    edge_folder: FakeFolder, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        scan = scan_folder(edge_folder.root)
    assert scan.class_to_idx["dog_empty"] == 3
    assert "dog_empty" in caplog.text and "no images" in caplog.text


def test_missing_source(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such folder"):
        scan_folder(tmp_path / "nope")


def test_source_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f.png").write_bytes(b"x")
    with pytest.raises(ScanError, match="not a folder"):
        scan_folder(tmp_path / "f.png")


def test_empty_source(tmp_path: Path) -> None:
    with pytest.raises(ScanError, match=r"no class folders found .* it is empty"):
        scan_folder(tmp_path)


def test_source_without_class_folders(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"x")
    with pytest.raises(ScanError, match=r"holds 1 file\(s\) but no folder"):
        scan_folder(tmp_path)


def test_class_folders_without_images(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "readme.md").write_text("hi")
    with pytest.raises(ScanError, match=r"found no image files .* extensions"):
        scan_folder(tmp_path)


def test_classes_from_text_file_and_output(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "val", count=6, classes=2)
    listing = tmp_path / "classes.txt"
    listing.write_text("zebra\nclass1\n\nclass0\n")
    scan = scan_folder(src, read_class_list(listing))
    assert scan.classes == ["zebra", "class1", "class0"]
    assert {s.label for s in scan.samples if s.path.startswith("class0/")} == {2}
    assert scan.empty_classes == ["zebra"]


def test_classes_from_refuses_unknown_folder(tmp_path: Path) -> None:
    src = build_uniform_folder(tmp_path / "val", count=6, classes=3)
    listing = tmp_path / "classes.txt"
    listing.write_text("class0\nclass1\n")
    with pytest.raises(ScanError, match="'class2' are not in the given label map"):
        scan_folder(src, read_class_list(listing))


def test_class_list_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no such file or imgpack output"):
        read_class_list(tmp_path / "missing.txt")
    (tmp_path / "dup.txt").write_text("a\nb\na\n")
    with pytest.raises(ScanError, match="more than once: a"):
        read_class_list(tmp_path / "dup.txt")
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(ScanError, match="empty"):
        read_class_list(tmp_path / "empty.txt")
    (tmp_path / "notout").mkdir()  # a folder is an output's label map, read by the route
    src = build_uniform_folder(tmp_path / "src", count=4, classes=2, size=8)
    with pytest.raises(ScanError, match=r"cannot take the classes from .*not an imgpack output"):
        convert(src, tmp_path / "out", "pt", classes_from=tmp_path / "notout", progress=False)
