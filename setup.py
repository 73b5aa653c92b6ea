"""Build the Cython extensions; all metadata lives in pyproject.toml."""

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

COMPILER_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": True,  # parsers read untrusted bytes: keep every index checked
    "wraparound": False,
    "cdivision": False,
    "embedsignature": True,
}


EXTENSIONS = ["_native.mapped", "_native.gather", "_native.safetensors", "_native.tftable", "_native.npy",
              "_native.npz", "_native.idindex", "_native.tensorindex"]


def ext(name: str) -> Extension:
    return Extension(
        f"fastckpt.{name}",
        [f"fastckpt/{name.replace('.', '/')}.pyx"],  # dotted names live in sub-packages
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O2"],
    )


setup(ext_modules=cythonize([ext(n) for n in EXTENSIONS], compiler_directives=COMPILER_DIRECTIVES))
