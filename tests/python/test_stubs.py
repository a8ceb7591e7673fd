"""The public API's type stubs (python/attncore/*.pyi, checked by mypy.stubtest), its docstrings,
and help() naming the package rather than the private module a name is defined in."""

import inspect
import os
import pathlib
import pydoc
import subprocess
import sys
import tempfile

import pytest

import attncore
import attncore.bert_padding
import attncore.flash_attn_interface
import attncore.torch

HERE = pathlib.Path(__file__).resolve().parent
PUBLIC_MODULES = (attncore, attncore.torch, attncore.flash_attn_interface,
                  attncore.bert_padding)


def test_stubs_match_the_package():
    pytest.importorskip("mypy", reason="Debian's mypy (scripts/install-deps.sh) runs stubtest")
    # stubtest checks the package this test imported (its directory first on the path: a
    # relative PYTHONPATH would not hold from the temporary directory it runs in).
    package_root = str(pathlib.Path(attncore.__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as cwd:  # outside the source tree
        result = subprocess.run(
            [sys.executable, "-m", "mypy.stubtest", "attncore", "--allowlist",
             str(HERE / "stubtest_allowlist.txt")],
            cwd=cwd, capture_output=True, text=True, env=env)
    assert result.returncode == 0, (
        "the type stubs python/attncore/*.pyi disagree with the package: a public function, "
        "class, method or __all__ entry added or changed needs its entry in the module's .pyi "
        "(python/attncore/__init__.pyi for names exported by the package). stubtest says:\n"
        + result.stdout + result.stderr)


def _public_objects():
    for module in PUBLIC_MODULES:
        for name in module.__all__:
            yield module, name, getattr(module, name)


@pytest.mark.parametrize("module,name,obj", list(_public_objects()),
                         ids=lambda x: x if isinstance(x, str) else "")
def test_public_names_have_docstrings_and_public_modules(module, name, obj):
    if not (inspect.isfunction(obj) or inspect.isclass(obj)):
        return
    assert obj.__doc__ and len(obj.__doc__.strip()) >= 20, f"{module.__name__}.{name}"
    assert not any(part.startswith("_") for part in obj.__module__.split(".")), \
        f"{module.__name__}.{name} is documented under {obj.__module__}"
    if inspect.isclass(obj) and not issubclass(obj, BaseException):
        for member, value in vars(obj).items():
            if member.startswith("_") or not (inspect.isfunction(value) or
                                              isinstance(value, property)):
                continue
            assert value.__doc__, f"{module.__name__}.{name}.{member} has no docstring"


def test_help_names_the_package():
    text = pydoc.render_doc(attncore.attention)
    assert "attncore" in text and "_attention" not in text.split("\n")[0]
    assert attncore.attention.__module__ == "attncore"
    assert attncore.scaled_dot_product_attention.__module__ == "attncore"
    assert "in module attncore\n" in pydoc.render_doc(attncore.flash_attn_func)
