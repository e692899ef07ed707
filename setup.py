"""imgpack's build: the package, and one optional C extension.

``imgpack._jpegregion`` decodes a JPEG's region alone through libjpeg-turbo's partial
decompression (``jpeg_skip_scanlines``, ``jpeg_crop_scanline``), for the training recipe's
random crops. It needs a C compiler and libjpeg-turbo's headers (Debian: ``libjpeg-dev``);
where they are missing the build goes on without it, and the crops decode through simplejpeg
(the whole image at a DCT scale, then the crop), within 2 of 255 of the same crops
(``docs/loading.md``, "Random crops").
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "imgpack._jpegregion",
            sources=["imgpack/_jpegregion.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ]
)
