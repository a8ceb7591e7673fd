"""The package's modules import each other along a DAG, and torch stays optional.

The graph is read from the sources in python/attncore with ast, counting every import wherever
it appears (module level or inside a function) and importlib.import_module calls with a
constant name; an import cycle fails, even one closed only by a lazy import.
"""

import ast
import pathlib
import re
import subprocess
import sys

import pytest

PYTHON_DIR = pathlib.Path(__file__).resolve().parents[2] / "python"
PACKAGE_DIR = PYTHON_DIR / "attncore"
PACKAGE = "attncore"
INIT = "__init__"


def _modules():
    """The package's module names: its .py files and the extension module _core."""
    names = {p.stem for p in PACKAGE_DIR.glob("*.py")}
    names.add("_core")
    return names


def _targets(node, modules):
    """The package modules one import node (or import_module call) reaches."""
    if isinstance(node, ast.Import):
        dotted = [a.name for a in node.names]
        return [_submodule(d[len(PACKAGE) + 1:]) if d.startswith(PACKAGE + ".") else INIT
                for d in dotted if d == PACKAGE or d.startswith(PACKAGE + ".")]
    if isinstance(node, ast.ImportFrom):
        if node.level == 0:
            if node.module != PACKAGE and not (node.module or "").startswith(PACKAGE + "."):
                return []
            inner = node.module[len(PACKAGE) + 1:]
        else:
            assert node.level == 1, f"import above the package (level {node.level})"
            inner = node.module or ""
        if inner:
            return [_submodule(inner)]
        # `from . import name`: the submodule `name`, else a name of the package's __init__.
        return [a.name if a.name in modules else INIT for a in node.names]
    if isinstance(node, ast.Call) and _is_import_module(node.func) and node.args:
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            name = arg.value
            if name.startswith("."):
                return [_submodule(name[1:])] if name[1:] else [INIT]
            if name == PACKAGE or name.startswith(PACKAGE + "."):
                return [_submodule(name[len(PACKAGE) + 1:])] if name != PACKAGE else [INIT]
        elif isinstance(arg, ast.JoinedStr):
            # f".{name}" and the like: the targets are not known statically.
            raise AssertionError(f"import_module with a computed package name at line "
                                 f"{node.lineno}; give it a constant name")
    return []


def _submodule(dotted):
    return dotted.split(".")[0]


def _is_import_module(func):
    return ((isinstance(func, ast.Attribute) and func.attr == "import_module")
            or (isinstance(func, ast.Name) and func.id in ("import_module", "__import__")))


def import_graph():
    modules = _modules()
    graph = {name: set() for name in modules}
    for path in sorted(PACKAGE_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _targets(node, modules):
                assert target in modules, f"{path.name} imports {target!r}, not a module of " \
                    f"{PACKAGE} ({sorted(modules)})"
                if target != path.stem:
                    graph[path.stem].add(target)
    return graph


def find_cycle(graph):
    """One cycle of the graph as a list of nodes (first == last), or None."""
    state = {}  # node -> "open" while on the DFS stack, "done" after
    stack = []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_find_cycle_sees_a_lazy_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_targets_of_each_import_form():
    modules = {"__init__", "_core", "_x", "torch"}
    cases = {
        "from . import _core": ["_core"],
        "from . import attention": [INIT],
        "from ._x import f": ["_x"],
        "from .torch import AttentionFunction": ["torch"],
        "import attncore.torch": ["torch"],
        "from attncore import _x": ["_x"],
        "import attncore": [INIT],
        "import torch": [],
        "importlib.import_module('.torch', __name__)": ["torch"],
    }
    for source, expected in cases.items():
        tree = ast.parse("def f():\n    " + source)
        found = [t for node in ast.walk(tree) for t in _targets(node, modules)]
        assert found == expected, source


def test_package_imports_form_a_dag():
    graph = import_graph()
    cycle = find_cycle(graph)
    edges = "; ".join(f"{m} -> {', '.join(sorted(graph[m]))}" for m in sorted(graph)
                      if graph[m])
    assert cycle is None, f"import cycle {' -> '.join(cycle)} (graph: {edges})"


def test_submodules_do_not_import_the_package_init():
    graph = import_graph()
    assert [m for m in graph if INIT in graph[m]] == []


def test_extension_module_imports_no_package_module():
    source = (PYTHON_DIR / "_core.cpp").read_text()
    assert not re.search(r'import\(\s*"attncore', source)


def _run(code):
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_numpy_use_does_not_import_torch():
    _run("import sys, numpy as np, attncore\n"
         "q = np.ones((1, 2, 3, 4), np.float32)\n"
         "attncore.scaled_dot_product_attention(q, q, q)\n"
         "attncore.flash_attn_func(q, q, q)\n"
         "cu = np.array([0, 1, 3], np.int32)\n"
         "attncore.flash_attn_varlen_qkvpacked_func(np.ones((3, 3, 2, 4), np.float32), cu, 2,\n"
         "                                          dropout_p=0.5, return_attn_probs=True)\n"
         "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n")


@pytest.mark.parametrize("first", ["attncore", "attncore.torch", "attncore._dropins",
                                   "attncore._attention", "attncore._autograd"])
def test_any_module_imports_first(first):
    _run(f"import importlib; importlib.import_module({first!r})\n"
         "import attncore, attncore.torch\n"
         "assert attncore.torch.scaled_dot_product_attention is "
         "attncore.scaled_dot_product_attention\n")


def test_package_name_torch_is_the_submodule():
    """attncore.torch is the submodule (never the torch library), also when reached as an
    attribute after a plain `import attncore`."""
    _run("import sys, torch, attncore\n"
         "t = torch.ones(1, 2, 3, 4)\n"
         "attncore.scaled_dot_product_attention(t, t, t)\n"
         "assert attncore.torch is sys.modules['attncore.torch']\n"
         "assert attncore.torch.AttentionFunction.__module__ == 'attncore.torch'\n"
         "assert issubclass(attncore.torch.AttentionFunction, torch.autograd.Function)\n")
