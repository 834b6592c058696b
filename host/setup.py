"""Builds the native data path (csrc/) with the machine's C compiler when `passing` is installed.

The library has no Python C-API code: passing/native.py loads it with ctypes (see
docs/architecture.md), so it is an ordinary shared object that the C tests, the
sanitizer build and the fuzz harness use as they are.

The AF_XDP I/O path (csrc/xsk.c) is built where the machine has what it needs: libxdp's and libbpf's
headers and libraries (Debian: libxdp-dev, libbpf-dev) and clang for the XDP program
(csrc/bpf/xdp_steer.bpf.c), which xdp_build.py compiles and embeds in the library as a byte array (a file
generated in the build directory, never in the sources). Elsewhere the library is built without it and
says so (pn_xdp_built() is 0; passing.xdp gives the reason).
"""

import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).resolve().parent))
import xdp_build  # noqa: E402


class BuildNative(build_ext):
    """build_ext that adds the AF_XDP path where it can be built (PASSING_XDP=0 leaves it out)."""

    def build_extensions(self) -> None:
        ext = self.extensions[0]
        sources, why = xdp_build.build(Path(self.build_temp) / "xdp")
        if not why:
            ext.sources += sources
            ext.define_macros.append(("PN_HAVE_XDP", "1"))
            ext.libraries += ["xdp", "bpf"]
        print(f"passing: AF_XDP path {'built' if not why else 'not built: ' + why}")
        super().build_extensions()


setup(
    ext_modules=[
        Extension(
            "passing._native",
            sources=["csrc/wire.c", "csrc/engine.c", "csrc/engine_jobs.c", "csrc/server.c", "csrc/stream.c",
                     "csrc/gather.c", "csrc/stream_loop.c", "csrc/quantize.c", "csrc/udp.c", "csrc/memory.c",
                     "csrc/frame.c", "csrc/xsk.c"],
            depends=["csrc/passing_native.h", "csrc/udp.h", "csrc/engine.h", "csrc/engine_state.h",
                     "csrc/stream_loop.h", "csrc/quantize.h", "csrc/frame.h", "csrc/xsk.h", "csrc/bpf/xdp_steer.bpf.c"],
            include_dirs=["csrc"],
            extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"],
            extra_link_args=["-pthread"],
            optional=False,
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
