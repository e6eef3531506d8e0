"""A package's public surface as plain data: each name in ``__all__`` with its kind and, for
functions and methods, the parameter list without annotations (``(a, b=1, *, stream)``)."""

import importlib
import inspect
from typing import Any

_KEEP_DUNDERS = ("__init__", "__call__", "__enter__", "__exit__")


def _params(fn) -> str:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return "(...)"
    out, star = [], False
    for p in sig.parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
            star = True
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text, star = "*" + p.name, True
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + p.name
        if p.default is not p.empty:
            text += f"={p.default!r}"
        out.append(text)
    return "(" + ", ".join(out) + ")"


def surface(module_name: str) -> dict:
    module = importlib.import_module(module_name)
    out: dict[str, Any] = {}
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isclass(obj):
            members = {}
            for attr, value in sorted(vars(obj).items()):
                if attr.startswith("_") and attr not in _KEEP_DUNDERS:
                    continue
                if isinstance(value, property):
                    members[attr] = "property"
                elif isinstance(value, (staticmethod, classmethod)):
                    members[attr] = _params(value.__func__)
                elif callable(value):
                    members[attr] = _params(value)
            out[name] = members
        elif callable(obj):
            out[name] = _params(obj)
        else:
            out[name] = repr(obj) if isinstance(obj, (tuple, str, int, float)) else type(obj).__name__
    return out


if __name__ == "__main__":  # print the surfaces, to update the pins in test_public_api.py
    import pprint
    import sys

    for mod in sys.argv[1:]:
        print(f"{mod!r}:")
        pprint.pprint(surface(mod), width=110, sort_dicts=True)
