"""install_flash_attn_alias(): `flash_attn` and two of its submodules in sys.modules, served by
attncore, so that model code written against flash-attn runs unchanged on CPUs."""

import importlib.machinery
import sys
import types

ALIASED = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding")


class _AliasLoader:
    """Finder and loader of the alias package (on sys.meta_path once the alias is installed):
    it finds `flash_attn` only while the alias is in sys.modules, so that
    importlib.reload(flash_attn) works; loading runs nothing (the contents are attncore's)."""

    @staticmethod
    def spec():
        # A package whose other submodules are not found: no locations to search. (Its repr
        # reads <module 'flash_attn' (attncore alias)>.)
        return importlib.machinery.ModuleSpec("flash_attn", _AliasLoader,
                                              origin="attncore alias", is_package=True)

    @staticmethod
    def find_spec(name, path=None, target=None):
        alias = getattr(sys.modules.get(name), "__attncore_alias__", False)
        return _AliasLoader.spec() if name == "flash_attn" and alias else None

    @staticmethod
    def create_module(spec):
        return None

    @staticmethod
    def exec_module(module):
        pass


def install_flash_attn_alias():
    """Makes `import flash_attn`, `from flash_attn import flash_attn_func`,
    `from flash_attn.flash_attn_interface import ...` and
    `from flash_attn.bert_padding import unpad_input, pad_input` work in this process, served
    by attncore.flash_attn_interface and attncore.bert_padding (flash-attn 2.8.3's functions
    and helpers; flash_attn.__version__ is "2.8.3"). Needs torch. Returns the `flash_attn`
    module; calling it again changes nothing.

    The package has a module spec (importlib.util.find_spec("flash_attn") finds it, as
    libraries that probe for flash-attn ask; importlib.reload(flash_attn) changes nothing) and
    its submodules are attncore's own modules, with theirs. It fools imports only: package
    metadata (importlib.metadata.version("flash_attn"), pip) still says flash-attn is not
    installed, other flash_attn submodules (layers, ops, the CUDA extension flash_attn_2_cuda)
    do not exist, and code that checks for a GPU (torch.cuda.is_available()) before calling
    flash-attn still sees none. RuntimeError when
    another flash_attn module is already imported (the alias never replaces a real one)."""
    existing = sys.modules.get("flash_attn")
    if existing is not None:
        if getattr(existing, "__attncore_alias__", False):
            return existing
        raise RuntimeError(f"install_flash_attn_alias: flash_attn is already imported "
                           f"(module={existing!r}, expected none); the alias never replaces "
                           "a real flash-attn")
    from . import bert_padding, flash_attn_interface
    package = types.ModuleType("flash_attn", "flash-attn 2.8.3's API, served by attncore (an "
                               "alias installed by attncore.install_flash_attn_alias())")
    package.__spec__, package.__loader__ = _AliasLoader.spec(), _AliasLoader
    package.__path__ = package.__spec__.submodule_search_locations
    package.__attncore_alias__ = True
    package.__version__ = flash_attn_interface.FLASH_ATTN_VERSION
    for name in flash_attn_interface.__all__:
        setattr(package, name, getattr(flash_attn_interface, name))
    package.flash_attn_interface = flash_attn_interface
    package.bert_padding = bert_padding
    sys.modules.update({"flash_attn.flash_attn_interface": flash_attn_interface,
                        "flash_attn.bert_padding": bert_padding, "flash_attn": package})
    if _AliasLoader not in sys.meta_path:
        sys.meta_path.insert(0, _AliasLoader)
    return package
