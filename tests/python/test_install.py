"""The two install routes (README: Python): pip into a virtual environment, built through
setup.py's CMake step, and `cmake --install` for system-wide installs. Each copy carries its own
package metadata beside the package, so whichever copy `import attncore` finds first, the
metadata importlib finds first is that copy's: one route cannot shadow the other unnoticed
(attncore imported from one copy while `importlib.metadata.version` describes the other).

The build tree this test imports attncore from is reused (ATTNCORE_CMAKE_BUILD_DIR): pip's build
runs CMake there, which rebuilds nothing that is up to date. Everything runs from a temporary
directory outside the source tree."""

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

import attncore

SOURCE = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(attncore.__file__).resolve().parents[2]
VERSION = attncore.__version__

# What a Python process reports about the attncore it imports.
PROBE = """
import importlib.metadata, json, attncore, attncore._core
dist = importlib.metadata.distribution("attncore")
print(json.dumps({"file": attncore.__file__, "core": attncore._core.__file__,
                  "version": attncore.__version__, "metadata": dist.version,
                  "metadata_of": str(dist.locate_file("attncore/__init__.py"))}))
"""


def _probe(python, cwd, pythonpath=None):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    out = subprocess.run([str(python), "-c", PROBE], cwd=cwd, env=env, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def _consistent(seen, where):
    """The imported copy lies under `where`, and its metadata is its own."""
    assert pathlib.Path(seen["file"]).resolve().is_relative_to(pathlib.Path(where).resolve()), seen
    assert pathlib.Path(seen["core"]).parent == pathlib.Path(seen["file"]).parent, seen
    assert pathlib.Path(seen["metadata_of"]).resolve() == pathlib.Path(seen["file"]).resolve(), \
        f"attncore imported from {seen['file']} but its metadata is {seen['metadata_of']}'s"
    assert seen["version"] == seen["metadata"] == VERSION, seen


@pytest.fixture(scope="module")
def installs():
    if not (BUILD / "CMakeCache.txt").exists():
        pytest.skip(f"attncore is not imported from a CMake build tree ({BUILD})")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(tmp / "env")],
                       check=True)
        env = dict(os.environ, ATTNCORE_CMAKE_BUILD_DIR=str(BUILD), PIP_NO_INDEX="1")
        env.pop("PYTHONPATH", None)
        subprocess.run([str(tmp / "env" / "bin" / "pip"), "install", "--no-build-isolation",
                        "--no-deps", "--no-cache-dir", "--quiet", str(SOURCE)],
                       cwd=tmp, env=env, check=True)
        subprocess.run(["cmake", "--install", str(BUILD), "--prefix", str(tmp / "prefix")],
                       check=True, capture_output=True)
        site = f"lib/python{sys.version_info.major}.{sys.version_info.minor}"
        yield {"tmp": tmp, "venv_python": tmp / "env" / "bin" / "python",
               "venv_site": tmp / "env" / site / "site-packages",
               "cmake_site": tmp / "prefix" / site / "dist-packages"}


def test_pip_installs_into_a_venv_with_metadata(installs):
    seen = _probe(installs["venv_python"], installs["tmp"])
    _consistent(seen, installs["venv_site"])


def test_cmake_install_carries_its_own_metadata(installs):
    seen = _probe(sys.executable, installs["tmp"], pythonpath=installs["cmake_site"])
    _consistent(seen, installs["cmake_site"])


def test_neither_route_shadows_the_other_unnoticed(installs):
    # Both copies visible: the one earlier on sys.path wins, with its own metadata.
    seen = _probe(installs["venv_python"], installs["tmp"], pythonpath=installs["cmake_site"])
    _consistent(seen, installs["cmake_site"])
    # The build tree, as tests and developers import it, is a copy with metadata too.
    seen = _probe(installs["venv_python"], installs["tmp"], pythonpath=BUILD / "python")
    _consistent(seen, BUILD / "python")


def test_a_wheel_is_built_offline(installs):
    # python3 -m build --no-isolation --wheel: the same setup.py, packed as a wheel.
    pytest.importorskip("build", reason="Debian's python3-build (scripts/install-deps.sh)")
    out = installs["tmp"] / "dist"
    env = dict(os.environ, ATTNCORE_CMAKE_BUILD_DIR=str(BUILD))
    env.pop("PYTHONPATH", None)
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--wheel", "--outdir",
                    str(out), str(SOURCE)], cwd=installs["tmp"], env=env, check=True,
                   capture_output=True)
    wheels = list(out.glob(f"attncore-{VERSION}-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    import zipfile
    names = zipfile.ZipFile(wheels[0]).namelist()
    for expected in ("attncore/__init__.py", "attncore/__init__.pyi", "attncore/py.typed"):
        assert expected in names
    assert any(n.startswith("attncore/_core") and n.endswith(".so") for n in names)
