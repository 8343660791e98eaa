"""`moeq_rs/_core.pyi` describes the native module as it is: every public name of the module
and of its classes is in the stub and nothing else is, with the runtime's parameter names in
the runtime's order."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import moeq_rs._core as core

STUB = Path(core.__file__).with_name("_core.pyi")


def _stub() -> dict[str, list[str] | None]:
    """Stub names (`f`, `Class`, `Class.method`) -> parameter names (None for classes and
    attributes)."""
    tree = ast.parse(STUB.read_text())
    out: dict[str, list[str] | None] = {}

    def params(f: ast.FunctionDef) -> list[str]:
        a = f.args
        return [p.arg for p in [*a.posonlyargs, *a.args, *a.kwonlyargs] if p.arg != "self"]

    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            out[node.name] = params(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = None
        elif isinstance(node, ast.ClassDef):
            out[node.name] = None
            for item in node.body:
                # Dunders (`__array_interface__`) are protocol, not API: not compared.
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("__"):
                    out[f"{node.name}.{item.name}"] = params(item)
    return out


def _runtime() -> dict[str, object]:
    out: dict[str, object] = {}
    for name in dir(core):
        if name.startswith("__") and name != "__version__":
            continue
        obj = getattr(core, name)
        if inspect.ismodule(obj):
            continue
        out[name] = obj
        if isinstance(obj, type) and obj.__module__.startswith("moeq_rs"):
            for attr in vars(obj):
                if not attr.startswith("__"):
                    out[f"{name}.{attr}"] = getattr(obj, attr)
    return out


def test_stub_and_module_name_the_same_things() -> None:
    stub, runtime = _stub(), _runtime()
    assert sorted(set(runtime) - set(stub)) == [], "in the module, missing from the stub"
    assert sorted(set(stub) - set(runtime)) == [], "in the stub, missing from the module"


def test_stub_parameters_are_the_runtime_parameters() -> None:
    stub, runtime = _stub(), _runtime()
    checked = 0
    for name, obj in runtime.items():
        text = getattr(obj, "__text_signature__", None)
        if text is None or stub.get(name) is None:
            continue
        real = [
            p.name
            for p in inspect.signature(obj).parameters.values()
            if p.name not in ("self", "$self", "cls", "$cls")
        ]
        assert stub[name] == real, name
        checked += 1
    assert checked >= 30
