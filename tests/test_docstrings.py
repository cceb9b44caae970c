"""Every public name has a docstring of its own that ``help()`` shows (issue 44).

The walk reads the public surface as ``tests/test_public_surface.py`` does: the names in
``__all__`` of ``MODULES`` and ``layers.ngram_store``, and ``MORE`` (``tests.helpers.public_names``); for each
class, its public methods and properties defined in this project (inherited ones from ``object``,
``Protocol``, ``Exception``, ``enum`` ... are not ours to document). A class needs a docstring of
its own (not a dataclass's or named tuple's generated signature); a method or property needs one
of its own, or one on a project class in the method's own class's MRO: the classes ``help()``
looks in. Constants carry no docstring and are left out. No docstring may send the reader to the
module's instead of saying what the name is ("(module doc)").
``pytest -s tests/test_docstrings.py`` prints the counts."""

from __future__ import annotations

import inspect
import types
from functools import cached_property
from typing import Any

from tests.helpers.public_names import MODULES, exported

PROJECT = ("gpu_runtime", "layers")
MEMBER_KINDS = (staticmethod, classmethod, property, cached_property)


def _ours(obj: Any) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in PROJECT


def _own_doc(obj: Any) -> str:
    """The docstring ``obj`` itself carries ("" if none): a class's own (not a base's, nor the
    signature a dataclass or named tuple writes in its place), a method's or property's own."""
    if inspect.isclass(obj):
        doc = vars(obj).get("__doc__") or ""
        generated = "\n" not in doc.strip() and doc.startswith(f"{obj.__name__}(")
        return "" if generated else doc.strip()
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    if isinstance(obj, property):
        obj = obj.fget
    if isinstance(obj, cached_property):
        obj = obj.func
    return (getattr(obj, "__doc__", None) or "").strip()


def _member_doc(cls: type, attr: str) -> str:
    """The docstring ``help(cls)`` shows for ``attr``: its definition's own, else that of the
    nearest project class in the defining class's MRO that defines ``attr`` with one."""
    definer = next(k for k in cls.__mro__ if attr in vars(k))
    for klass in definer.__mro__:
        if attr in vars(klass) and _ours(klass):
            doc = _own_doc(vars(klass)[attr])
            if doc:
                return doc
    return ""


def public_docs() -> dict[str, str]:
    """Qualified name -> the docstring help() shows for it ("" where there is none)."""
    found: dict[str, str] = {}
    seen: set[int] = set()
    for module, name, obj in exported([*MODULES, "layers.ngram_store"]):
        key = f"{module}.{name}"
        if id(obj) in seen or not (isinstance(obj, types.ModuleType) or callable(obj)):
            continue  # a name seen through another module, or a constant
        seen.add(id(obj))
        found[key] = _own_doc(obj) if not isinstance(obj, types.ModuleType) else (obj.__doc__ or "").strip()
        if not inspect.isclass(obj):
            continue
        for attr in dir(obj):
            definer = next((k for k in obj.__mro__ if attr in vars(k)), None)
            if attr.startswith("_") or definer is None or not _ours(definer):
                continue
            member = vars(definer)[attr]
            if inspect.isfunction(member) or isinstance(member, MEMBER_KINDS):
                found[f"{key}.{attr}"] = _member_doc(obj, attr)
    return found


def test_every_public_name_has_its_own_docstring():
    docs = public_docs()
    missing = sorted(name for name, doc in docs.items() if not doc)
    print(f"\ndocstrings: {len(docs) - len(missing)} of {len(docs)} public names")
    assert not missing, f"{len(missing)} public names without a docstring help() shows: {missing}"


def test_no_docstring_only_points_at_the_module_doc():
    pointing = sorted(name for name, doc in public_docs().items() if "(module doc)" in doc)
    assert not pointing, f"say what the name is, not '(module doc)': {pointing}"


def test_the_walk_reaches_methods_properties_and_inherited_project_members():
    """The walk itself: classes, their methods and properties, members a public class inherits
    from a project base (``DenseWeight.rows``), and an implementation's own docstring where its
    interface's would not reach ``help()`` (``CudaBackend.alloc``)."""
    docs = public_docs()
    for name in (
        "gpu_runtime.CudaBackend",
        "gpu_runtime.CudaBackend.alloc",
        "gpu_runtime.GpuBackend.alloc",
        "gpu_runtime.DeviceBuffer.closed",
        "gpu_runtime.cli",
        "layers.dense_weight.DenseWeight.rows",
        "layers.ngram_store.TableLayout.table_dim",
        "layers.overlay.OverlaySlots.embed_rows_tab",
        "layers.tensor_parallel.nccl.NcclGroup.wait",
        "layers.ngram_embed.NgramShard.of",
    ):
        assert name in docs, f"the walk misses {name}"
    assert "gpu_runtime.GpuError.with_traceback" not in docs, "Exception's methods are not ours to document"
