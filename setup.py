"""Builds the Cython extensions of pyllama/_fast with optimisation on, and the CUDA kernels of
cuda_src/ into pyllama/backend/cuda/kernels/*.fatbin when nvcc is found.

Set PYLLAMA_PORTABLE=1 to build without -march=native (for binaries that move between machines),
PYLLAMA_NO_CUDA_BUILD=1 to skip the CUDA kernels.
"""
import importlib.util
import os
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
FAST = HERE / "pyllama" / "_fast"
CUDA_SRC = HERE / "cuda_src"
KERNELS = Path("pyllama") / "backend" / "cuda" / "kernels"


def _cuda_build():
    # by path: importing the package would need its dependencies at build time
    spec = importlib.util.spec_from_file_location("_pyllama_cuda_build", HERE / "pyllama" / "backend" / "cuda" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildExtWithCuda(build_ext):
    """The Cython extensions, then the CUDA fatbins: into the source tree (editable installs load
    them from there) and into the build directory (wheels)."""

    def run(self):
        super().run()
        out_dirs = [HERE / KERNELS]
        if not self.inplace and self.build_lib:
            out_dirs.append(Path(self.build_lib) / KERNELS)
        _cuda_build().build_for_install(CUDA_SRC, out_dirs, log=lambda msg: print(msg, flush=True))

compile_args = [
    "-O3",
    "-fopenmp",
    # Float reductions vectorize only when reassociation is allowed; results stay deterministic
    # for a given binary, which is what the greedy-equality invariants need.
    "-fassociative-math",
    "-fno-signed-zeros",
    "-fno-trapping-math",
    "-fno-math-errno",
    "-Wno-unreachable-code",
]
if os.environ.get("PYLLAMA_PORTABLE") != "1":
    compile_args.append("-march=native")

extensions = [
    Extension(
        f"pyllama._fast.{pyx.stem}",
        [str(pyx.relative_to(HERE))],
        include_dirs=[np.get_include(), str(FAST / "csrc")],
        extra_compile_args=compile_args,
        extra_link_args=["-fopenmp"],
        language="c++",
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for pyx in sorted(FAST.glob("*.pyx"))
]

setup(
    cmdclass={"build_ext": BuildExtWithCuda},
    ext_modules=cythonize(
        extensions,
        language_level=3,
        compiler_directives={
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
