"""Builds the attncore Python package with setuptools: the extension module attncore._core comes
from the CMake build of this repository (target attncore_python), the rest from python/attncore.

Environment:
    ATTNCORE_CMAKE_BUILD_DIR  an existing CMake build directory to build in and take the module
                              from (reused as it is: nothing is rebuilt that is up to date);
                              default: a fresh Release build under build/setuptools
    CMAKE_BUILD_PARALLEL_LEVEL  build jobs (CMake's own variable)
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


def cmake_project_version():
    """The version of CMakeLists.txt's project(): the package's version is the library's."""
    text = (ROOT / "CMakeLists.txt").read_text()
    match = re.search(r"project\(\s*attncore\s+VERSION\s+([0-9][0-9.]*)", text)
    if match is None:
        raise RuntimeError("setup.py: CMakeLists.txt has no project(attncore VERSION x.y.z)")
    return match.group(1)


class CMakeBuild(build_ext):
    """Runs CMake for attncore._core and copies the module where setuptools packs it."""

    def build_extension(self, ext):
        build_dir = os.environ.get("ATTNCORE_CMAKE_BUILD_DIR")
        if build_dir:
            build_dir = pathlib.Path(build_dir).resolve()
        else:
            build_dir = (ROOT / "build" / "setuptools" / "cmake").resolve()
        if not (build_dir / "CMakeCache.txt").exists():
            subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build_dir),
                            "-DCMAKE_BUILD_TYPE=Release", "-DATTNCORE_PYTHON=ON",
                            "-DATTNCORE_BUILD_TESTS=OFF", "-DATTNCORE_BUILD_BENCH=OFF",
                            f"-DPython3_EXECUTABLE={sys.executable}"], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "attncore_python"],
                       check=True)
        built = sorted((build_dir / "python" / "attncore").glob("_core*.so"))
        if len(built) != 1:
            raise RuntimeError(f"setup.py: expected one attncore/_core*.so in {build_dir}/python, "
                               f"found {[str(p) for p in built]}")
        target = pathlib.Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], target)


(ROOT / "build" / "setuptools").mkdir(parents=True, exist_ok=True)
setup(
    version=cmake_project_version(),
    packages=["attncore"],
    package_dir={"": "python"},
    package_data={"attncore": ["py.typed", "*.pyi"]},
    ext_modules=[Extension("attncore._core", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
    # setuptools' own build files under build/setuptools, beside the CMake build directories.
    options={"build": {"build_base": "build/setuptools"},
             "egg_info": {"egg_base": "build/setuptools"}},
    zip_safe=False,
)
