"""Preloading a whole dataset onto a device and iterating batches there.

Once a dataset fits in GPU memory, the fastest loader is none: :class:`DeviceLoader` copies every
image to the device once, as uint8 (4x smaller than float32), and then draws each epoch's
permutation, gathers batches, converts and normalizes them, and applies simple augmentation
(random crop with padding, horizontal flip) on the device, vectorized over the batch. With
``device="cpu"`` the same code runs on the CPU, which is how the test suite covers it.

The training recipe (``recipe=``: a fresh random-resized crop of every sample each epoch) cannot
be loaded once: with one, :class:`DeviceLoader` streams, the reader decoding and cropping each
batch on the host and the batch then copied to the device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from imgpack.errors import ImgpackError, OptionError
from imgpack.formats.batch import collate
from imgpack.formats.dataset_base import ImageDataset
from imgpack.images import ImagePolicy, resize_pixels
from imgpack.loading.sampler import ShardSampler
from imgpack.loading.state import Loader
from imgpack.recipe import Crop
from imgpack.units import parse_image_size, whole_number

#: Samples copied to the device per step while loading (bounded host memory).
LOAD_CHUNK = 1024


def _available_bytes(device: torch.device) -> int:
    """Free memory on ``device``: ``torch.cuda.mem_get_info`` for CUDA, MemAvailable for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))


def _gib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB"


def dataset_normalize(dataset: Dataset[Any], name: str) -> tuple[Sequence[float], Sequence[float]]:
    """``normalize="dataset"``: the ``(mean, std)`` the dataset's conversion recorded."""
    if name != "dataset":
        raise OptionError(f"invalid normalize {name!r}: expected (mean, std) or 'dataset'")
    stats = getattr(dataset, "stats", None)
    if stats is None or stats.mean is None or stats.std is None:
        where = getattr(dataset, "root", type(dataset).__name__)
        why = (
            "converted with --no-stats"
            if stats is not None
            else "made before imgpack recorded them"
        )
        raise OptionError(
            f"{where}: normalize='dataset' needs the mean and std its conversion records, and "
            f"this output has none ({why}): convert it again, or give normalize=(mean, std)"
        )
    if any(v == 0 for v in stats.std):
        raise OptionError(f"{getattr(dataset, 'root', '')}: a channel's std is 0 (every pixel "
                          "the same): normalize='dataset' would divide by zero")  # fmt: skip
    return stats.mean, stats.std


class DeviceLoader:
    """Load a dataset onto ``device`` once, then iterate batches entirely on the device.

    Args:
        dataset_or_path: an imgpack reader (or its output directory).
        device: ``"cuda"``, ``"cuda:1"``, ``"cpu"``...
        batch_size, shuffle, drop_last: as for ``DataLoader``.
        dtype: ``torch.uint8`` (batches as stored), ``torch.float16``, ``torch.bfloat16`` or
            ``torch.float32`` (batches divided by 255). Default: ``torch.float32`` with
            ``normalize``, ``torch.uint8`` without.
        normalize: ``(mean, std)`` per channel on the 0-1 scale, as torchvision's ``Normalize``
            after ``ToTensor``: ``(x / 255 - mean) / std``; or ``"dataset"``: the mean and std
            its conversion recorded over every stored pixel (``ds.stats``). Needs a float
            ``dtype`` (float32 unless told otherwise).
        seed: seeds the per-epoch permutation and the augmentation (with :meth:`set_epoch`).
        crop_padding: random crop of the original size from the image zero-padded by this many
            pixels on each side (0: off).
        hflip: probability of flipping each image horizontally (0: off).
        size: ``N`` or ``(H, W)``: resize while loading (the image policy's centre-crop resize;
            imgpack's readers decode a JPEG at the largest DCT scale that still covers the size
            first); needed when the dataset's images do not all have one size.
        indices: load only these samples (a subset).
        ddp: split the dataset across DDP ranks (``rank``/``world_size`` default to
            ``torch.distributed``): rank ``r`` loads samples ``r, r + world_size, ...`` — disjoint
            parts that together cover the dataset (they may differ by one sample).
        workers: processes that read and decode while loading (default: 0 for raw data, the
            usable CPUs otherwise).
        memory_limit: bytes the dataset may take on the device (default: what is free now).
        progress: show a progress bar while loading.
        fields: numeric fields of the output (``int`` or ``float`` that every sample has:
            :mod:`imgpack.fields`) loaded onto the device beside the labels: each batch is then
            ``(images, labels, *fields)`` (an int64 or float32 tensor each).
        recipe: the training recipe's crop (:class:`imgpack.recipe.RandomResizedCrop`, or
            :class:`~imgpack.recipe.CenterCrop` for evaluation), its boxes drawn from ``seed``.
            A fresh crop of every sample each epoch cannot be loaded once: the loader then
            streams instead, each batch decoded and cropped on the host by the reader (in
            ``workers`` processes, a :class:`~imgpack.loading.Loader` over a
            :class:`~imgpack.loading.ShardSampler`) and copied to the device, where ``dtype``
            and ``normalize`` apply. A reader opened with ``recipe=`` streams with its own.
            Its state resumes on any number of workers and ranks.
    """

    def __init__(
        self,
        dataset_or_path: Dataset[Any] | str | os.PathLike[str],
        device: str | torch.device = "cuda",
        batch_size: int = 256,
        shuffle: bool = True,
        drop_last: bool = False,
        dtype: torch.dtype | None = None,
        normalize: tuple[Sequence[float], Sequence[float]] | str | None = None,
        seed: int = 0,
        crop_padding: int = 0,
        hflip: float = 0.0,
        size: int | tuple[int, int] | None = None,
        indices: Sequence[int] | None = None,
        ddp: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        workers: int | None = None,
        memory_limit: int | None = None,
        progress: bool = True,
        fields: Sequence[str] = (),
        recipe: Crop | None = None,
    ) -> None:
        if isinstance(dataset_or_path, (str, os.PathLike)):
            from imgpack.readers import open_dataset

            dataset: Dataset[Any] = open_dataset(dataset_or_path, recipe=recipe, seed=seed)
        else:
            dataset = dataset_or_path
        if batch_size < 1:
            raise OptionError(f"invalid batch_size {batch_size!r}: expected 1 or more")
        if dtype is None:  # normalized values need a float; stored pixels are bytes
            dtype = torch.uint8 if normalize is None else torch.float32
        if dtype not in (torch.uint8, torch.float16, torch.float32, torch.bfloat16):
            raise OptionError(
                f"invalid dtype {dtype}: expected torch.uint8, float16, bfloat16 or float32"
            )
        if normalize is not None and dtype == torch.uint8:
            raise OptionError(
                "normalize needs a float dtype: dtype=torch.uint8 cannot hold normalized values "
                "(leave dtype out for float32, or give torch.float16, bfloat16 or float32)"
            )
        if isinstance(normalize, str):
            normalize = dataset_normalize(dataset, normalize)
        if crop_padding < 0 or not 0.0 <= hflip <= 1.0:
            raise OptionError("crop_padding must be >= 0 and hflip a probability in 0..1")
        self.device = _usable_device(device)
        self.batch_size, self.shuffle, self.drop_last = batch_size, shuffle, drop_last
        self.dtype, self.seed, self.epoch = dtype, seed, 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches) of a loaded state
        self._taken = 0
        self.crop_padding, self.hflip = crop_padding, hflip
        self.rank, self.world_size = _rank_and_world(ddp, rank, world_size)
        self.classes: list[str] = list(getattr(dataset, "classes", []))
        self._stream: Loader | None = None
        self.policy: ImagePolicy | None = None
        if recipe is not None or getattr(getattr(dataset, "options", None), "recipe", None):
            given: dict[str, object] = {"size": size, "indices": indices, "fields": fields or None}
            given |= {"crop_padding": crop_padding or None, "hflip": hflip or None}
            self._stream, channels = self._streamed(dataset, recipe, workers, given)
            self._set_normalize(normalize, channels)
            return
        self.policy = ImagePolicy(size=parse_image_size(size)) if size is not None else None
        if self.policy is not None and isinstance(dataset, ImageDataset):
            # imgpack's readers resize as they decode (a JPEG at a reduced DCT scale)
            dataset = dataset.with_options(size=self.policy.size)
        n = len(dataset)  # type: ignore[arg-type]
        chosen = np.arange(n) if indices is None else np.asarray(indices, dtype=np.int64)
        self.indices = chosen[self.rank :: self.world_size]
        shape = self._image_shape(dataset)
        self.fields = (fields,) if isinstance(fields, str) else tuple(fields)
        self._check_memory(shape, memory_limit)
        #: The numeric fields' columns on the device, in ``fields``' order.
        self.columns = [self._column(dataset, name) for name in self.fields]
        self.images = torch.empty(
            (len(self.indices), *shape), dtype=torch.uint8, device=self.device
        )
        self.labels = torch.empty(len(self.indices), dtype=torch.int64, device=self.device)
        self._load(dataset, shape, workers, progress)
        self._set_normalize(normalize, shape[0])

    def _set_normalize(
        self, normalize: tuple[Sequence[float], Sequence[float]] | None, channels: int
    ) -> None:
        if normalize is not None:
            mean, std = (
                torch.as_tensor(v, dtype=torch.float32).reshape(1, -1, 1, 1) for v in normalize
            )
            if mean.shape[1] not in (1, channels) or std.shape[1] not in (1, channels):
                raise OptionError(f"normalize needs 1 or {channels} values for mean and std")
            self._mean = mean.to(self.device, self.dtype)
            self._std = std.to(self.device, self.dtype)
        self._normalize = normalize is not None

    # -- streaming (a recipe) ----------------------------------------------------------------
    def _streamed(
        self,
        dataset: Dataset[Any],
        recipe: Crop | None,
        workers: int | None,
        given: dict[str, Any],
    ) -> tuple[Loader, int]:
        """The loader of a recipe's batches (the reader crops on the host, in ``workers``
        processes; each batch then goes to the device) and the images' channels."""
        if not isinstance(dataset, ImageDataset):
            raise OptionError(
                "DeviceLoader(recipe=...) crops as an imgpack reader decodes: give an output's "
                f"path or a reader from open_dataset, not a {type(dataset).__name__}"
            )
        clash = [name for name, value in given.items() if value is not None]
        if clash:
            raise OptionError(
                f"DeviceLoader: {', '.join(clash)} cannot be given with a recipe (it streams "
                "each epoch's crops of the whole output: the recipe has its size and flip)"
            )
        if recipe is not None and dataset.options.recipe is not recipe:
            dataset = dataset.with_options(recipe=recipe, seed=self.seed)
        if workers is None:
            from imgpack.system import usable_cpus

            workers = usable_cpus()
        sampler = self._sampler = ShardSampler(
            dataset,
            shuffle=self.shuffle,
            seed=self.seed,
            num_replicas=self.world_size,
            rank=self.rank,
        )
        loader = Loader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=self.drop_last,
            num_workers=whole_number(workers, "workers"),
            collate_fn=collate,
            pin_memory=self.device.type == "cuda",
            persistent_workers=workers > 0,
        )
        return loader, dataset.channels

    def _streamed_batches(self) -> Iterator[tuple[torch.Tensor, ...]]:
        assert self._stream is not None
        self._sampler.set_epoch(self.epoch)
        cuda = self.device.type == "cuda"
        for images, labels in self._stream:
            images = images.to(self.device, non_blocking=cuda)
            yield self._convert(images), labels.to(self.device, non_blocking=cuda)

    # -- loading -----------------------------------------------------------------------------
    def _image_shape(self, dataset: Dataset[Any]) -> tuple[int, int, int]:
        manifest = getattr(dataset, "manifest", None)
        image = manifest.image if manifest is not None else {}
        channels = int(image.get("channels") or 3)
        if self.policy is not None:
            assert self.policy.size is not None
            return (channels, *self.policy.size)
        if image.get("height") and image.get("width"):
            return (channels, int(image["height"]), int(image["width"]))
        raise OptionError(
            "DeviceLoader needs images of one size: convert with --size (or --encoding raw "
            "--size), or pass size=N / size=(H, W) to resize while loading"
        )

    def _column(self, dataset: Dataset[Any], name: str) -> torch.Tensor:
        """Field ``name``'s values of the loaded samples, on the device."""
        found = getattr(dataset, "fields", {}).get(name)
        if found is None:
            raise OptionError(f"DeviceLoader: the dataset has no field {name!r}")
        if found.type not in ("int", "float") or found.optional:
            raise OptionError(
                f"DeviceLoader: field {name!r} is {found.spec}; it carries numeric fields every "
                "sample has (int, float) to the device: read the others through a DataLoader"
            )
        column = dataset.field(name)  # type: ignore[attr-defined]
        return column[torch.from_numpy(self.indices)].to(self.device)

    def _check_memory(self, shape: tuple[int, int, int], limit: int | None) -> None:
        count = len(self.indices)
        need = count * int(np.prod(shape)) + count * 8 * (1 + len(self.fields))
        free = limit if limit is not None else _available_bytes(self.device)
        if need > free:
            c, h, w = shape
            raise ImgpackError(
                f"the dataset needs {_gib(need)} on {self.device} ({count} images of {c}x{h}x{w} "
                f"uint8) but only {_gib(free)} is available. Load it smaller (size=N: at "
                f"{h // 2}x{w // 2} it would take {_gib(need / 4)}), load a subset (indices=...), "
                "split it across DDP ranks (ddp=True), or stream it with a DataLoader instead"
            )

    def _load(
        self,
        dataset: Dataset[Any],
        shape: tuple[int, int, int],
        workers: int | None,
        progress: bool,
    ) -> None:
        raw = getattr(getattr(dataset, "manifest", None), "encoding", None) == "raw"
        if workers is None:
            from imgpack.system import usable_cpus

            workers = 0 if raw else usable_cpus()
        loader = DataLoader(
            dataset,
            batch_size=LOAD_CHUNK,
            sampler=self.indices.tolist(),
            num_workers=workers,
            collate_fn=collate,
        )
        cuda = self.device.type == "cuda"
        # Two pinned staging buffers: one is copied to the device while the next chunk is filled.
        staging = [
            torch.empty((LOAD_CHUNK, *shape), dtype=torch.uint8, pin_memory=cuda)
            for _ in range(2 if cuda else 1)
        ]
        events: list[Any] = [None] * len(staging)
        start = 0
        bar = tqdm(
            total=len(self.indices), unit="img", desc=f"load to {self.device}", disable=not progress
        )
        with bar:
            for step, (images, labels) in enumerate(loader):
                count = len(labels)
                slot = step % len(staging)
                if events[slot] is not None:
                    events[slot].synchronize()  # the buffer's previous copy has finished
                buffer = staging[slot][:count]
                self._fill(buffer, images, shape)
                self.images[start : start + count].copy_(buffer, non_blocking=cuda)
                self.labels[start : start + count].copy_(torch.as_tensor(labels), non_blocking=cuda)
                if cuda:
                    events[slot] = torch.cuda.Event()
                    events[slot].record()
                start += count
                bar.update(count)
        if cuda:
            torch.cuda.synchronize(self.device)

    def _fill(self, buffer: torch.Tensor, images: Any, shape: tuple[int, int, int]) -> None:
        """Copy a loaded chunk into ``buffer`` (k, C, H, W), resizing images that need it."""
        if isinstance(images, torch.Tensor) and tuple(images.shape[1:]) == shape:
            buffer.copy_(images)
            return
        for k, image in enumerate(images):
            if tuple(image.shape) != shape:
                if self.policy is None:
                    raise OptionError(
                        f"image of shape {tuple(image.shape)} in a dataset of {shape}; pass size="
                    )
                pixels = resize_pixels(
                    np.ascontiguousarray(image.permute(1, 2, 0).numpy()), self.policy
                )
                buffer[k].copy_(torch.from_numpy(np.array(pixels)).permute(2, 0, 1))
            else:
                buffer[k].copy_(image)

    # -- iterating ---------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose permutation (and augmentation) the next iteration uses."""
        self.epoch = epoch

    def __len__(self) -> int:
        if self._stream is not None:
            return len(self._stream)
        n = len(self.indices)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _generator(self) -> torch.Generator:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed * 1_000_003 + self.epoch)
        return gen

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self._stream is not None:
            yield from self._streamed_batches()
            return
        n = len(self.indices)
        gen = self._generator()
        if self.shuffle:
            order = torch.randperm(n, generator=gen, device=self.device)
        else:
            order = torch.arange(n, device=self.device)
        first, self._resume = (self._resume or (self.epoch, 0)), None
        start = first[1] if first[0] == self.epoch else 0
        for batch in range(start):  # skipped: draw what their augmentation drew, read nothing
            self._draws(len(order[batch * self.batch_size : (batch + 1) * self.batch_size]), gen)
        self._taken = start
        for batch in range(start, len(self)):
            idx = order[batch * self.batch_size : (batch + 1) * self.batch_size]
            images = self.images.index_select(0, idx)
            labels = self.labels.index_select(0, idx)
            out = self._transform(images, gen)
            self._taken = batch + 1
            if self.columns:
                yield (out, labels, *(column.index_select(0, idx) for column in self.columns))
            else:
                yield out, labels

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The seed, the epoch and the batches of it handed out (all on the device, nothing is
        prefetched): with :meth:`load_state_dict` the next iteration continues after them, with
        the same augmentation draws an uninterrupted epoch makes. The order is per rank (each
        rank holds its own part of the dataset), so a state resumes on the same number of
        ranks and the same ``batch_size``. A loader that streams a recipe saves its
        :class:`~imgpack.loading.Loader`'s state, which resumes on any number of workers and
        ranks."""
        if self._stream is not None:
            return {
                "imgpack_device_loader": 1,
                "seed": self.seed,
                "epoch": self.epoch,
                "loader": self._stream.state_dict(),
            }
        return {
            "imgpack_device_loader": 1,
            "seed": self.seed,
            "epoch": self.epoch,
            "batches": self._taken,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "samples": len(self.indices),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict` (see there); another seed, batch size, world size
        or dataset is refused with :class:`~imgpack.errors.OptionError`."""
        if not isinstance(state, dict) or state.get("imgpack_device_loader") != 1:
            raise OptionError("not a DeviceLoader state (from DeviceLoader.state_dict())")
        mine = self.state_dict()
        if ("loader" in state) != ("loader" in mine):
            which = ("streams a recipe", "preloads")
            if "loader" not in state:
                which = which[::-1]
            raise OptionError(
                f"the saved DeviceLoader state is of a loader that {which[0]}; this one "
                f"{which[1]}: it cannot resume here"
            )
        if self._stream is not None:
            if state.get("seed") != self.seed:
                raise OptionError(
                    f"the saved DeviceLoader state has another seed ({state.get('seed')!r}, this "
                    f"loader {self.seed!r}); it cannot resume here"
                )
            self._stream.load_state_dict(state["loader"])
            self.epoch = int(state["epoch"])
            return
        for key in ("seed", "batch_size", "world_size", "samples"):
            if state.get(key) != mine[key]:
                raise OptionError(
                    f"the saved DeviceLoader state has another {key} ({state.get(key)!r}, this "
                    f"loader {mine[key]!r}); it cannot resume here"
                )
        batches = state.get("batches")
        if type(batches) is not int or not 0 <= batches <= len(self):
            raise OptionError("the saved DeviceLoader state is damaged (batches)")
        self.epoch = int(state["epoch"])
        self._resume = (self.epoch, batches)

    def _draws(
        self, count: int, gen: torch.Generator
    ) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, torch.Tensor | None]:
        """The random draws of a batch of ``count`` images, in the generator's order: crop
        offsets (top, left) and which images flip. A skipped batch draws them too, so a resumed
        epoch augments as an uninterrupted one."""
        offsets = None
        if self.crop_padding:
            span = 2 * self.crop_padding + 1
            top = torch.randint(0, span, (count,), generator=gen, device=self.device)
            left = torch.randint(0, span, (count,), generator=gen, device=self.device)
            offsets = (top, left)
        flip = None
        if self.hflip:
            flip = torch.rand(count, generator=gen, device=self.device) < self.hflip
        return offsets, flip

    def _transform(self, images: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        offsets, flip = self._draws(len(images), gen)
        if offsets is not None:
            images = random_crop(images, self.crop_padding, offsets=offsets)
        if flip is not None:
            images = torch.where(flip[:, None, None, None], images.flip(-1), images)
        return self._convert(images)

    def _convert(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images on the device in ``dtype``, normalized where asked."""
        if self.dtype != torch.uint8:
            images = images.to(self.dtype).div_(255)
            if self._normalize:
                images = images.sub_(self._mean).div_(self._std)
        return images


def _usable_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``, refused in one line when this machine has none of it
    (torch's own message is an ``AssertionError`` deep in its CUDA initialisation)."""
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise OptionError(f"invalid device {device!r}: {exc}") from None
    if found.type == "cuda" and not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA device"
        raise OptionError(
            f"DeviceLoader(device={str(device)!r}): this machine has no usable CUDA device "
            f"({build}); use device='cpu' (the same code, in host memory) or read the output "
            "with a DataLoader"
        )
    if (
        found.type == "cuda"
        and found.index is not None
        and found.index >= torch.cuda.device_count()
    ):
        raise OptionError(
            f"DeviceLoader(device={str(device)!r}): this machine has "
            f"{torch.cuda.device_count()} CUDA device(s) (cuda:0 ...)"
        )
    return found


def random_crop(
    images: torch.Tensor,
    padding: int,
    generator: torch.Generator | None = None,
    offsets: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """For each image of a ``(B, C, H, W)`` batch, an ``H x W`` window at a random offset of the
    image zero-padded by ``padding`` on every side (torchvision's ``RandomCrop(padding=...)``),
    in one gather for the whole batch. ``offsets``: the ``(top, left)`` of each window, drawn
    already (else drawn here from ``generator``)."""
    b, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (padding, padding, padding, padding))
    if offsets is None:
        span = 2 * padding + 1
        top = torch.randint(0, span, (b,), generator=generator, device=images.device)
        left = torch.randint(0, span, (b,), generator=generator, device=images.device)
    else:
        top, left = offsets
    rows = (top[:, None] + torch.arange(h, device=images.device))[:, None, :, None]  # (B,1,H,1)
    cols = (left[:, None] + torch.arange(w, device=images.device))[:, None, None, :]  # (B,1,1,W)
    batch = torch.arange(b, device=images.device)[:, None, None, None]
    channel = torch.arange(images.shape[1], device=images.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def _rank_and_world(ddp: bool, rank: int | None, world_size: int | None) -> tuple[int, int]:
    if not ddp and rank is None and world_size is None:
        return 0, 1
    dist = torch.distributed
    if rank is None or world_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise OptionError(
                "ddp=True needs torch.distributed initialised, or rank= and world_size="
            )
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise OptionError(f"rank {rank} is outside 0..{world_size - 1}")
    return rank, world_size


__all__ = ["DeviceLoader", "random_crop"]
