"""What a page assumes the reader already has, made in the working folder before it runs.

Each function is named in a page's entry in tests/test_docs.py. Everything is small and seeded,
and a server listens on 127.0.0.1 only (the page runs in a network namespace of its own).
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for conftest

from conftest import start_moto

from imgpack import convert
from imgpack.sample import make_sample_folder

S3_PORT = 9000


def images() -> None:
    """./images: the sample folder (300 images, 5 classes)."""
    make_sample_folder("images", 300, 5, 0)


def s3() -> None:
    """moto's S3 server on 127.0.0.1:9000 (the endpoint docs/storage.md names), the AWS
    variables pointing at it, and the buckets the pages use: ``bucket``, ``datasets`` (with
    ``raw-images/``, an image folder) and ``other`` (with ``out/``, an output)."""
    atexit.register(start_moto(S3_PORT).terminate)
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{S3_PORT}",
        AWS_ACCESS_KEY_ID=os.environ.get("AWS_ACCESS_KEY_ID", "minio"),
        AWS_SECRET_ACCESS_KEY=os.environ.get("AWS_SECRET_ACCESS_KEY", "minio123"),
        AWS_DEFAULT_REGION="us-east-1",
    )
    import fsspec

    fs = fsspec.filesystem("s3")
    for bucket in ("bucket", "datasets", "other"):
        fs.mkdir(bucket)
    make_sample_folder("s3-fixture/images", 60, 3, 1)
    fs.put("s3-fixture/images", "datasets/raw-images", recursive=True)
    convert("s3-fixture/images", "s3://other/out", "pt", progress=False)


def sources() -> None:
    """What docs/sources.md converts: ./images, an LMDB output ``old-lmdb``, TFRecords
    (``tf-shards/`` and ``tf/train-*.tfrecord``), a split folder ``dataset/`` and Hugging Face
    datasets saved to disk (``saved-dataset``, ``saved-dataset-dict``, and ``saved`` with the
    columns ``img`` and ``y``), a label list, unlabelled images and WebDataset shards."""
    import datasets

    make_sample_folder("images", 60, 5, 0)  # small: the Hugging Face steps dominate this page
    convert("images", "old-lmdb", "lmdb", progress=False)
    convert("images", "tf-shards", "tfrecord", progress=False, shard_size=20_000)
    Path("tf").mkdir()
    for shard in sorted(Path("tf-shards").glob("*.tfrecord")):
        os.link(shard, Path("tf") / shard.name.replace("data-", "train-"))
    for i, split in enumerate(("train", "val", "test")):
        make_sample_folder(Path("dataset") / split, 20, 3, 10 + i)
    dataset = datasets.load_dataset("imagefolder", data_dir="images", split="train")
    dataset.save_to_disk("saved-dataset")
    datasets.DatasetDict(
        {"train": dataset.select(range(0, 40)), "test": dataset.select(range(40, 60))}
    ).save_to_disk("saved-dataset-dict")
    dataset.rename_columns({"image": "img", "label": "y"}).save_to_disk("saved")
    _label_list_and_shards()


def _label_list_and_shards() -> None:
    """``kaggle/images/`` (flat) with ``kaggle/labels.csv`` (``path,label`` rows), ``flat/``
    (images without labels) and ``wds-shards/`` (two tars as the webdataset package writes
    them: ``key.jpg``/``key.png`` + ``key.cls``)."""
    import io
    import shutil
    import tarfile

    folder = Path("kaggle/images")
    folder.mkdir(parents=True)
    rows, members = ["path,label"], []
    classes = sorted(p.name for p in Path("images").iterdir())
    for name in classes:
        for file in sorted((Path("images") / name).iterdir()):
            shutil.copy(file, folder / f"{name}-{file.name}")
            rows.append(f"images/{name}-{file.name},{name}")
            members.append((file, classes.index(name)))
    Path("kaggle/labels.csv").write_text("\n".join(rows) + "\n")
    shutil.copytree(folder, "flat")
    Path("wds-shards").mkdir()
    for shard in range(2):
        with tarfile.open(f"wds-shards/shard-{shard:06d}.tar", "w") as tar:
            for k, (file, label) in enumerate(members[shard::2]):
                for name, data in ((f"{shard}{k:05d}{file.suffix}", file.read_bytes()),
                                   (f"{shard}{k:05d}.cls", str(label).encode())):  # fmt: skip
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
