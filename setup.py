"""Builds the Cython extensions of pyllama/_fast with optimisation on.

Set PYLLAMA_PORTABLE=1 to build without -march=native (for binaries that move between machines).
"""
import os
from pathlib import Path

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

HERE = Path(__file__).parent
FAST = HERE / "pyllama" / "_fast"

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
        include_dirs=[np.get_include()],
        extra_compile_args=compile_args,
        extra_link_args=["-fopenmp"],
        language="c++",
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
    )
    for pyx in sorted(FAST.glob("*.pyx"))
]

setup(
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
