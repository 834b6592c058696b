"""Builds the native data path (csrc/) with the machine's C compiler when `passing` is installed.

The library has no Python C-API code: passing/native.py loads it with ctypes (see
docs/architecture.md), so it is an ordinary shared object that the C tests, the
sanitizer build and the fuzz harness use as they are.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "passing._native",
            sources=["csrc/wire.c", "csrc/engine.c", "csrc/engine_jobs.c", "csrc/server.c", "csrc/stream.c",
                     "csrc/gather.c", "csrc/stream_loop.c", "csrc/quantize.c", "csrc/udp.c", "csrc/memory.c"],
            depends=["csrc/passing_native.h", "csrc/udp.h", "csrc/engine.h", "csrc/engine_state.h",
                     "csrc/stream_loop.h", "csrc/quantize.h"],
            include_dirs=["csrc"],
            extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
            optional=False,
        )
    ]
)
