"""The README's example script runs as written and prints what its comments say."""

import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_example_script_runs():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    example = next(b for b in blocks if b.startswith("# example.py"))
    result = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True,
                            env=dict(os.environ), timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "ndarray float32 (2, 8, 128, 64)" in result.stdout
    assert "max |flash - reference|:" in result.stdout


def test_drop_in_snippets_name_real_functions():
    """The two drop-in imports of the README exist."""
    import attncore.torch
    text = README.read_text()
    for name in ("scaled_dot_product_attention", "flash_attn_func"):
        assert f"from attncore.torch import {name}" in text
        assert callable(getattr(attncore.torch, name))
