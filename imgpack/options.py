"""Every conversion option, validated once, with its default in one place.

:class:`ConvertOptions` is what the CLI builds from its flags, what :func:`imgpack.convert` builds
from its keywords, and what the engine and the writers read. Its defaults are the documented
ones; the image-policy defaults come from :class:`~imgpack.images.ImagePolicy` itself. Building
one checks every value and normalises it (``size="224"`` becomes ``(224, 224)``, ``"1GiB"``
becomes bytes, the format's ``-o`` options are parsed by its spec), so a bad option fails before
a long scan, never after it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

from imgpack import formats, sources
from imgpack.errors import OptionError
from imgpack.fields import Field, check_name, parse_fields
from imgpack.formats import FormatSpec
from imgpack.images import ASPECT_MODES, Encoding, ImagePolicy, parse_color
from imgpack.units import parse_byte_size, parse_image_size

ON_ERROR = ("fail", "skip")
_POLICY = ImagePolicy()
_ENCODING = Encoding()


@dataclass(frozen=True)
class ConvertOptions:
    """The options of one conversion (see :func:`imgpack.pipeline.convert` for each)."""

    format: str = "pt"
    encoding: str = _ENCODING.name
    size: tuple[int, int] | None = None
    quality: int = _ENCODING.quality
    resize: str = _POLICY.resize
    resample: str = _POLICY.resample
    grayscale: bool = False
    background: tuple[int, int, int] = _POLICY.background
    max_pixels: int | None = _POLICY.max_pixels
    workers: int | None = None  # None: the usable CPUs of the machine that converts
    shard_size: int | None = None  # None: the format's default (sharded formats)
    overwrite: bool = False
    #: Continue an interrupted conversion of the same SRC, DST and options from its checkpoint.
    resume: bool = False
    #: Add SRC's images to the existing output at DST as new shards after its last one
    #: (:mod:`imgpack.appending`); its files stay as they are, its manifest is replaced last.
    append: bool = False
    on_error: str = "fail"
    classes_from: str | None = None
    #: An explicit label map (the classes in label order), e.g. the union of a dataset's splits.
    classes: tuple[str, ...] | None = None
    #: Convert a SRC whose top-level folders are split names (train, val, test) as classes.
    allow_split_names: bool = False
    #: SRC's kind (:func:`imgpack.sources.names`); ``None``: detected from SRC.
    source: str | None = None
    #: The source kind's own options (``-s KEY=VALUE``), parsed by its spec when SRC's kind is
    #: known: ``image_column``/``label_column`` of a Hugging Face dataset, a label list's ``file``.
    source_options: dict[str, Any] = field(default_factory=dict)
    progress: bool = True
    #: Partitioned conversion: convert only part ``part`` of ``num_parts`` contiguous slices of
    #: the scan (``imgpack merge`` joins the parts).
    num_parts: int = 1
    part: int = 0
    #: The format's own options (``-o KEY=VALUE``), parsed by its spec.
    format_options: dict[str, Any] = field(default_factory=dict)
    #: Measure the stored pixels for the dataset statistics' mean and std (:mod:`imgpack.stats`):
    #: a full decode of each kept JPEG instead of the validating 1/8-scale one.
    stats: bool = True
    #: The source's fields to keep (:mod:`imgpack.fields`), by name, in the output's order;
    #: ``None``: every field the source offers; ``()``: none.
    fields: tuple[str, ...] | None = None
    #: Types of source fields as ``NAME:TYPE`` (``--field caption:str``), taken instead of the
    #: ones the source would infer.
    field_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        spec = formats.get(self.format)
        set_ = object.__setattr__  # frozen: normalise in place once, here
        if self.size is not None:
            set_(self, "size", parse_image_size(self.size))
        set_(self, "background", parse_color(self.background))
        self.encoding_spec  # noqa: B018 - validates encoding and quality
        self.policy  # noqa: B018 - validates resize, resample, max_pixels
        if self.resize in ASPECT_MODES and self.size is None:
            raise OptionError(f"--resize {self.resize} needs --size N (the side it sets)")
        if self.encoding == "raw" and self.size is None:
            raise OptionError("encoding 'raw' needs a fixed image size: give --size N or HxW")
        if self.encoding == "raw" and self.resize in ASPECT_MODES:
            raise OptionError(
                f"encoding 'raw' needs one image size, and --resize {self.resize} keeps each "
                "image's aspect ratio (sizes vary): use --resize crop or stretch, or encoding "
                "jpeg, png or original"
            )
        if self.fields is not None:
            names = self.fields.split(",") if isinstance(self.fields, str) else self.fields
            kept = tuple(check_name(str(n).strip()) for n in names if str(n).strip())
            if len(set(kept)) != len(kept):
                raise OptionError(f"fields: a name is given twice ({', '.join(kept)})")
            set_(self, "fields", kept)
        types = (self.field_types,) if isinstance(self.field_types, str) else self.field_types
        set_(self, "field_types", tuple(f.spec for f in parse_fields(types)))
        if not isinstance(self.stats, bool):
            raise OptionError(f"invalid stats {self.stats!r}: expected True or False")
        if self.workers is not None and (isinstance(self.workers, bool) or self.workers < 1):
            raise OptionError(f"invalid workers {self.workers!r}: expected 1 or more")
        for name in ("num_parts", "part"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise OptionError(f"invalid {name} {value!r}: expected an integer")
        if self.num_parts < 1:
            raise OptionError(f"invalid num_parts {self.num_parts}: expected 1 or more")
        if not 0 <= self.part < self.num_parts:
            raise OptionError(
                f"invalid part {self.part}: expected 0 to {self.num_parts - 1} "
                f"(parts are numbered from 0 for --num-parts {self.num_parts})"
            )
        if self.on_error not in ON_ERROR:
            raise OptionError(
                f"invalid on_error {self.on_error!r}: expected one of {', '.join(ON_ERROR)}"
            )
        if self.shard_size is not None and not spec.sharded:
            raise OptionError(
                f"format {self.format!r} writes a single file; --shard-size does not apply to it"
            )
        if spec.sharded:
            size = self.shard_size if self.shard_size is not None else spec.default_shard_size
            set_(self, "shard_size", parse_byte_size(size or 0, "shard size"))
        if self.classes_from is not None:
            set_(self, "classes_from", os.fspath(self.classes_from))
        if self.classes is not None:
            if self.classes_from is not None:
                raise OptionError("give classes or classes_from, not both")
            set_(self, "classes", tuple(str(c) for c in self.classes))
            if not self.classes or len(set(self.classes)) != len(self.classes):
                raise OptionError("classes must be a non-empty list of distinct names")
        set_(self, "format_options", spec.check_options(self.format_options))
        if self.append:
            self._check_append(spec.appendable)
        if self.source is not None:
            sources.get(self.source)  # an unknown kind fails here; its options when SRC is known
        set_(self, "source_options", dict(self.source_options))

    def _check_append(self, appendable: bool) -> None:
        """What ``--append`` cannot go with, refused in one line."""
        if not appendable:
            raise OptionError(
                f"--append: format {self.format!r} cannot be added to (its writer cannot start "
                "from an output of its own): convert the output's source and SRC together into "
                "a new output, or use one of imgpack's own formats, which take --append"
            )
        if self.num_parts > 1 and not formats.get(self.format).sharded:
            raise OptionError(
                f"--append: a {self.format} output is one file, written by one process; append "
                "without --num-parts"
            )
        clash = next(
            (name for name, given in (
                ("--overwrite", self.overwrite),
                ("--classes", self.classes is not None),
                ("--classes-from", self.classes_from is not None),
            ) if given),
            None,
        )  # fmt: skip
        if clash is not None:
            why = {
                "--overwrite": "it adds to DST, never replaces it",
            }.get(clash, "the output's classes keep their labels, new ones come after")
            raise OptionError(f"--append does not go with {clash}: {why}")

    @classmethod
    def create(cls, format: str = "pt", **options: Any) -> ConvertOptions:
        """Options from keywords: the names of this class's fields, the source shorthands
        (``labels="list.csv"``: a label list; ``no_labels=True``: unlabelled images;
        ``image_column=``/``label_column=``: source options), and any other keyword as a format
        option (``map_size="1GiB"``, ``compression="gzip"``)."""
        options = _source_shorthands(options)
        own = {f.name for f in fields(cls)} - {"format", "format_options"}
        given = {k: v for k, v in options.items() if k in own}
        format_options = {
            **options.get("format_options", {}),
            **{k: v for k, v in options.items() if k not in own and k != "format_options"},
        }
        return cls(format=format, format_options=format_options, **given)

    @classmethod
    def default(cls, name: str) -> Any:
        """The default of option ``name`` (for the CLI's help)."""
        for f in fields(cls):
            if f.name == name:
                return f.default
        raise KeyError(name)

    @property
    def spec(self) -> FormatSpec:
        return formats.get(self.format)

    @property
    def policy(self) -> ImagePolicy:
        return ImagePolicy(
            size=self.size,
            resize=self.resize,
            resample=self.resample,
            channels=1 if self.grayscale else 3,
            background=self.background,
            max_pixels=self.max_pixels,
        )

    @property
    def typed_fields(self) -> tuple[Field, ...]:
        """:attr:`field_types` as fields."""
        return tuple(parse_fields(self.field_types))

    @property
    def encoding_spec(self) -> Encoding:
        return Encoding(self.encoding, self.quality)

    def recorded(self) -> dict[str, Any]:
        """What the manifest records under ``options``."""
        return {
            "encoding": self.encoding,
            "quality": self.quality if self.encoding == "jpeg" else None,
            "shard_size": self.shard_size,
            "on_error": self.on_error,
            "max_pixels": self.max_pixels,
            **({} if self.stats else {"stats": False}),
            **self.format_options,
        }


#: Keywords that name a source kind or set a source option.
SOURCE_SHORTHANDS = ("labels", "no_labels", "image_column", "label_column")


def _source_shorthands(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the source shorthands turned into ``source`` and ``source_options``."""
    options = dict(options)
    chosen: dict[str, Any] = dict(options.pop("source_options", None) or {})
    kind = options.get("source")
    labels = options.pop("labels", None)
    no_labels = options.pop("no_labels", False)
    if labels is not None and no_labels:
        raise OptionError("give labels (a label list) or no_labels, not both")
    for name, value, what in (
        ("labels", labels, labels is not None),
        ("unlabelled", None, no_labels),
    ):
        if not what:
            continue
        if kind not in (None, name):
            raise OptionError(f"{'--labels' if name == 'labels' else '--no-labels'} reads a "
                              f"{name!r} source, not {kind!r}")  # fmt: skip
        kind = name
        if value is not None:
            chosen["file"] = os.fspath(value)
    for key in ("image_column", "label_column"):
        value = options.pop(key, None)
        if value is not None:
            chosen[key] = value
    if kind is not None:
        options["source"] = kind
    options["source_options"] = chosen
    return options
