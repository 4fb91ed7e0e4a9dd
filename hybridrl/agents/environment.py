"""Which class is the environment, what kind it is, and how it travels to worker processes.

``env.name`` is ``path/to/env.py:ClassName`` or ``package.module:ClassName`` (or the class
itself). Two kinds (:func:`environment_kind`):

* ``"environment"``: the class has ``reset`` and ``step`` (the ``Environment`` protocol
  of ``types.py``);
* ``"tools"``: otherwise its public methods (no leading underscore) are the tools
  (``tool_env.py``).

Invariants: a class loaded from a file carries ``hybridrl_spec`` (its absolute
``path:ClassName``) and is pickled for a worker as that spec (:func:`dumps_env_class`), so
the worker loads the same file again (``rewards/user_code.py`` registers it in ``sys.modules``
there too, which is what lets instances of its classes pickle between calls); any other
class must be importable by name in a fresh process.
"""

from __future__ import annotations

import inspect
import io
import pickle
from typing import Any, Callable, Literal

from hybridrl.rewards.user_code import load_object

ENV_EXAMPLE = "path/to/env.py:ClassName or package.module:ClassName"
Kind = Literal["environment", "tools"]


def load_environment(spec: str | type, *, where: str = "env.name") -> type:
    """The class that ``spec`` names (a class is returned as is)."""
    if isinstance(spec, type):
        return spec
    obj, path = load_object(spec, where, ENV_EXAMPLE)
    if not isinstance(obj, type):
        what = "a function" if inspect.isroutine(obj) else f"a {type(obj).__name__}"
        raise ValueError(f"{where}={spec!r}: {spec.rpartition(':')[2]!r} is {what}, not a class; "
                         "name a class (an Environment with reset/step, or a class whose methods are tools)")
    if path is not None:
        # how it travels to a worker: as this spec, loaded there from the same absolute path
        obj.hybridrl_spec = f"{path}:{spec.rpartition(':')[2]}"
    return obj


def public_methods(cls: type) -> dict[str, Callable]:
    """``{name: function}`` of ``cls``'s public methods (plain, static and class methods,
    inherited ones included, ``object``'s excluded), in definition order (base classes first)."""
    methods: dict[str, Callable] = {}
    for klass in reversed(cls.__mro__[:-1]):  # [:-1]: not object
        for name, attr in vars(klass).items():
            if name.startswith("_"):
                continue
            if inspect.isfunction(attr) or isinstance(attr, (staticmethod, classmethod)):
                methods[name] = getattr(cls, name)
            else:
                methods.pop(name, None)  # overridden by a non-method (an attribute, a property)
    return methods


def environment_kind(cls: type) -> Kind:
    """``"environment"`` for a class with callable ``reset`` and ``step``; else ``"tools"``
    (its public methods are the tools); raises when it has neither."""
    if callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None)):
        return "environment"
    if public_methods(cls):
        return "tools"
    raise ValueError(f"env class {cls.__qualname__!r} has neither reset() and step() (an Environment) nor public "
                     "methods (tools); add reset/step, or methods without a leading underscore")


class _EnvPickler(pickle.Pickler):
    """Pickles a class that carries its own ``hybridrl_spec`` as that spec; refuses
    classes of ``__main__``, which a worker does not import; the rest pickles as usual."""

    def reducer_override(self, obj: Any):
        if isinstance(obj, type):
            spec = vars(obj).get("hybridrl_spec")  # its own, not one inherited from a base class
            if isinstance(spec, str):
                return _load_spec, (spec,)
            if obj.__module__ == "__main__":
                raise pickle.PicklingError(f"{obj.__qualname__!r} is defined in the script being run")
        return NotImplemented


def _load_spec(spec: str) -> type:
    return load_environment(spec)


def dumps_env_class(cls: type) -> bytes:
    """``cls`` pickled as a worker payload; one-line ValueError if a fresh process could not load it."""
    buf = io.BytesIO()
    try:
        _EnvPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(cls)
    except Exception as e:  # noqa: BLE001 - PicklingError, or AttributeError for local classes
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"env class {cls.__qualname__!r} cannot be sent to a worker process ({type(e).__name__}: "
                         f"{why}); define it at module level in a file and pass 'path/to/env.py:ClassName'") from None
    return buf.getvalue()
