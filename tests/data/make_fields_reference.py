"""How the TensorFlow references of per-sample fields in this folder were made (run once, with
TensorFlow 2.21 in an environment of its own: `pip install tensorflow-cpu`; not run by the tests).

    python tests/data/make_fields_reference.py tests/data

1. `imgpack-written-fields.tfrecord`: an imgpack `tfrecord` output's shard (its
   `imgpack-written-fields.json` manifest beside it), made by imgpack from a label list with a
   field of every type (the test re-creates nothing: it reads this file).
   `imgpack-written-fields.tf.json`: what `tf.io.parse_single_example` reads of its field
   features, record by record.
2. `tensorflow-written-fields.tfrecord`: four `tf.train.Example` records written by
   `tf.io.TFRecordWriter`, with features beyond the image's (object-detection boxes and class
   texts, a source id, a count on some records); `tensorflow-written-fields.tf.json`: the
   features as TensorFlow reads them back.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf
from PIL import Image


def main(folder: Path) -> None:
    imgpack_file = folder / "imgpack-written-fields.tfrecord"
    spec = {
        "caption": tf.io.FixedLenFeature([], tf.string),
        "score": tf.io.FixedLenFeature([], tf.float32),
        "count": tf.io.FixedLenFeature([], tf.int64),
        "tags": tf.io.VarLenFeature(tf.int64),
        "boxes": tf.io.VarLenFeature(tf.float32),
        "meta": tf.io.FixedLenFeature([], tf.string),
        "blob": tf.io.FixedLenFeature([], tf.string),
        "note": tf.io.FixedLenFeature([], tf.string, default_value=""),
    }
    read = []
    for record in tf.data.TFRecordDataset(str(imgpack_file)):
        parsed = tf.io.parse_single_example(record, spec)
        read.append(
            {
                "caption": parsed["caption"].numpy().decode("utf-8"),
                "score": float(parsed["score"].numpy()),
                "count": int(parsed["count"].numpy()),
                "tags": tf.sparse.to_dense(parsed["tags"]).numpy().tolist(),
                "boxes": tf.sparse.to_dense(parsed["boxes"]).numpy().tolist(),
                "meta": json.loads(parsed["meta"].numpy().decode("utf-8")),
                "blob": parsed["blob"].numpy().decode("utf-8"),
                "note": parsed["note"].numpy().decode("utf-8") or None,
            }
        )
    (folder / "imgpack-written-fields.tf.json").write_text(json.dumps(read, indent=1) + "\n")

    written = folder / "tensorflow-written-fields.tfrecord"
    with tf.io.TFRecordWriter(str(written)) as writer:
        for i in range(4):
            buffer = io.BytesIO()
            Image.fromarray(np.full((6, 8, 3), 40 * i, np.uint8)).save(buffer, "JPEG")
            feature = {
                "image/encoded": tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[buffer.getvalue()])
                ),
                "image/format": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"jpeg"])),
                "image/class/label": tf.train.Feature(int64_list=tf.train.Int64List(value=[i % 2])),
                "image/source_id": tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[f"source-{i}".encode()])
                ),
                "image/object/bbox/xmin": tf.train.Feature(
                    float_list=tf.train.FloatList(value=[0.25 * k for k in range(i)])
                ),
                "image/object/class/text": tf.train.Feature(
                    bytes_list=tf.train.BytesList(value=[b"cat", b"dog"][: i % 3])
                ),
            }
            if i % 2:
                feature["image/object/count"] = tf.train.Feature(
                    int64_list=tf.train.Int64List(value=[i])
                )
            example = tf.train.Example(features=tf.train.Features(feature=feature))
            writer.write(example.SerializeToString())
    spec2 = {
        "image/source_id": tf.io.FixedLenFeature([], tf.string),
        "image/object/bbox/xmin": tf.io.VarLenFeature(tf.float32),
        "image/object/class/text": tf.io.VarLenFeature(tf.string),
        "image/object/count": tf.io.FixedLenFeature([], tf.int64, default_value=-1),
    }
    read2 = []
    for record in tf.data.TFRecordDataset(str(written)):
        parsed = tf.io.parse_single_example(record, spec2)
        count = int(parsed["image/object/count"].numpy())
        read2.append(
            {
                "image/source_id": parsed["image/source_id"].numpy().decode("utf-8"),
                "image/object/bbox/xmin": tf.sparse.to_dense(parsed["image/object/bbox/xmin"])
                .numpy()
                .tolist(),
                "image/object/class/text": [
                    v.decode("utf-8")
                    for v in tf.sparse.to_dense(parsed["image/object/class/text"]).numpy().tolist()
                ],
                "image/object/count": None if count < 0 else count,
            }
        )
    (folder / "tensorflow-written-fields.tf.json").write_text(json.dumps(read2, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
