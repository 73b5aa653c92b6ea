"""Build the Cython extensions; all metadata lives in pyproject.toml."""

import os
import shutil
import sys
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

COMPILER_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": True,  # parsers read untrusted bytes: keep every index checked
    "wraparound": False,
    "cdivision": False,
    "embedsignature": True,
}


EXTENSIONS = ["_native.mapped", "_native.gather", "_native.safetensors", "_native.tftable", "_native.npy",
              "_native.npz", "_native.idindex", "_native.tensorindex"]

HERE = Path(__file__).resolve().parent
# Whatever any compiled module can depend on besides its own .pyx: every .pxd it may cimport, and the flags
# set here.
SHARED_SOURCES = [*HERE.glob("fastckpt/_native/*.pxd"), HERE / "setup.py"]
JOBS = os.cpu_count() or 1


def say(message: str) -> None:
    # pip shows a build's output with -v (or when it fails); `setup.py build_ext` always shows it.
    print(f"fastckpt build: {message}", file=sys.stderr, flush=True)


def ext(name: str) -> Extension:
    return Extension(
        f"fastckpt.{name}",
        [f"fastckpt/{name.replace('.', '/')}.pyx"],  # dotted names live in sub-packages
        include_dirs=[numpy.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O2"],
    )


class BuildExt(build_ext):
    """Compiles the extensions in parallel, and reuses a module already built in the source tree when it is
    newer than every source: pip builds an editable install in a fresh temporary directory each time, so
    `pip install -e ".[test]"` after `pip install -e .` would otherwise compile all of them again."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = JOBS

    def build_extensions(self) -> None:
        stale = [e.name.rsplit(".", 1)[-1] for e in self.extensions if self._built_copy(e) is None]
        if stale:
            say(f"compiling {len(stale)} of {len(self.extensions)} extensions with {self.parallel} parallel "
                f"job(s), a minute or two per job (needs a C compiler and the Python headers): {', '.join(stale)}")
        else:
            say(f"all {len(self.extensions)} extensions are up to date in the source tree; nothing to compile")
        super().build_extensions()
        say("done")

    def _built_copy(self, extension: Extension) -> Path | None:
        """The module the source tree already holds for `extension`, if it is newer than every source."""
        built = HERE / self.get_ext_filename(extension.name)  # the name carries the interpreter's ABI tag
        if not built.is_file():
            return None
        # cythonize has replaced each .pyx in `sources` by the .c it generates (regenerated when the .pyx changes)
        own = [HERE / Path(s).with_suffix(".pyx") for s in extension.sources]
        sources = [p for p in own if p.is_file()] + SHARED_SOURCES
        newest = max(p.stat().st_mtime for p in sources)
        return built if built.stat().st_mtime >= newest else None

    def build_extension(self, extension: Extension) -> None:
        target = Path(self.get_ext_fullpath(extension.name))
        reuse = self._built_copy(extension)
        if reuse is not None and reuse.resolve() != target.resolve():
            say(f"reusing {reuse.relative_to(HERE)}")
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(reuse, target)
            return
        say(f"compiling {extension.name}")
        super().build_extension(extension)
        say(f"compiled {extension.name}")


setup(
    ext_modules=cythonize([ext(n) for n in EXTENSIONS], compiler_directives=COMPILER_DIRECTIVES, nthreads=JOBS),
    cmdclass={"build_ext": BuildExt},
)
