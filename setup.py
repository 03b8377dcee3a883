"""Build of the Cython extensions; all metadata lives in pyproject.toml.

Set ``ENGINE_CYTHON_CHECKS=1`` to compile with bounds and wraparound checks on and
assertions enabled; CI runs the test suite a second time in that mode.
"""

import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

CHECKS = os.environ.get("ENGINE_CYTHON_CHECKS", "0") == "1"

directives = {
    "language_level": "3",
    "boundscheck": CHECKS,
    "wraparound": CHECKS,
    "initializedcheck": CHECKS,
    "cdivision": not CHECKS,
    "embedsignature": True,
}
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if not CHECKS:
    macros.append(("NDEBUG", None))
compile_args = ["-O3"] if not CHECKS else ["-O1", "-g", "-UNDEBUG"]

extensions = [
    Extension(
        "engine.base._crc32c",
        ["engine/base/_crc32c.pyx"],
        include_dirs=["engine/base"],
        define_macros=macros,
        extra_compile_args=compile_args,
    ),
    Extension(
        "engine.format._header",
        ["engine/format/_header.pyx"],
        include_dirs=[np.get_include()],
        define_macros=macros,
        extra_compile_args=compile_args,
    ),
    # local reads: the copy engine (_io) and the SIGBUS guard of its mapped copies, the split
    # copies over a thread pool, the page-cache calls, the pread gathers of strided runs
    *(
        Extension(f"engine.io.{name}", [f"engine/io/{name}.pyx"], define_macros=macros, extra_compile_args=compile_args)
        for name in ("_guard", "_io", "_split", "_pages", "_spans")
    ),
    Extension(
        "engine.gpu._cudart",
        ["engine/gpu/_cudart.pyx"],
        define_macros=macros,
        extra_compile_args=compile_args,
        libraries=["dl"],
    ),
    Extension(
        "engine.gpu._chunk_plan",
        ["engine/gpu/_chunk_plan.pyx"],
        define_macros=macros,
        extra_compile_args=compile_args,
    ),
    Extension(
        "engine.gpu._copy_loop",
        ["engine/gpu/_copy_loop.pyx"],
        define_macros=macros,
        extra_compile_args=compile_args,
    ),
    Extension(
        "engine.gpu._ring",
        ["engine/gpu/_ring.pyx"],
        define_macros=macros,
        extra_compile_args=compile_args,
    ),
]

setup(
    ext_modules=cythonize(
        extensions,
        compiler_directives=directives,
        # checked and optimised builds generate their C in separate folders, so switching
        # between them never compiles a stale C file of the other kind
        build_dir=os.path.join("build", "cython-checks" if CHECKS else "cython"),
    ),
)
