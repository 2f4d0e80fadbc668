"""Where the C API's header, shared library and CMake package lie (get_include, get_library_dir,
get_cmake_dir): in an installed package, its own directories; in a source checkout (PYTHONPATH=python,
_core built by tools/devbuild), the repository's include/ and the build directory _core links."""

from __future__ import annotations

from pathlib import Path

from . import _core

_PKG = Path(__file__).resolve().parent
_HEADER = "dflash_native.h"
_CONFIG = "dflash_nativeConfig.cmake"


def get_include() -> str:
    """The directory holding dflash_native.h (the C API) and dflash_native.pxd's header."""
    for d in (_PKG / "include", _PKG.parent.parent / "include"):  # installed; source checkout
        if (d / _HEADER).is_file():
            return str(d)
    raise FileNotFoundError(f"[dflash_native] no {_HEADER} in {_PKG / 'include'} nor the source tree's include/")


def get_library_dir() -> str:
    """The directory of libdflash_native, the shared library _core runs on (link C API users to it)."""
    return str(Path(_core.library_path()).resolve().parent)


def get_cmake_dir() -> str:
    """The directory of dflash_nativeConfig.cmake: put it in CMAKE_PREFIX_PATH (or dflash_native_DIR),
    then find_package(dflash_native CONFIG) gives the imported target dflash_native::dflash_native."""
    for d in (_PKG / "cmake", Path(get_library_dir())):  # installed; the build tree's own config
        if (d / _CONFIG).is_file():
            return str(d)
    raise FileNotFoundError(f"[dflash_native] no {_CONFIG} in {_PKG / 'cmake'} nor beside {get_library_dir()}")
