"""imgpack's build: the package, and two optional C extensions.

``imgpack._jpegregion`` decodes a JPEG's region alone through libjpeg-turbo's partial
decompression (``jpeg_skip_scanlines``, ``jpeg_crop_scanline``), for the training recipe's
random crops. It needs a C compiler and libjpeg-turbo's headers (Debian: ``libjpeg-dev``);
where they are missing the build goes on without it, and the crops decode through simplejpeg
(the whole image at a DCT scale, then the crop), within 2 of 255 of the same crops
(``docs/loading.md``, "Random crops").

``imgpack._pixelsums`` sums an image's values and their squares per channel in one pass, for
the statistics a conversion keeps (:func:`imgpack.images.pixel_sums`). It needs a C compiler
only; without it the same exact sums are made with numpy, about four times slower.

``imgpack._batchcopy`` copies a random crop into its slot of a batch, flipped on the way, with
streaming stores (:func:`imgpack.recipe.place`). It needs a C compiler only; without it torch
copies (and flips) each crop.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "imgpack._jpegregion",
            sources=["imgpack/_jpegregion.c"],
            libraries=["jpeg"],
            optional=True,
        ),
        Extension("imgpack._pixelsums", sources=["imgpack/_pixelsums.c"], optional=True),
        Extension("imgpack._batchcopy", sources=["imgpack/_batchcopy.c"], optional=True),
    ]
)
