"""Load a user object named ``path/to/file.py:Name`` or ``package.module:Name``.

Unlike the rewards' loader, a file is imported as a *registered* module: it goes into
``sys.modules`` under a name derived from its absolute path (``hybridrl_user_<stem>_<hash>``).
Why: an environment's state is pickled between calls, and pickle finds a class by
``module.qualname``; a module that is not in ``sys.modules`` cannot be found again, so an
instance of a class (or a dataclass) defined in such a file would not pickle. Registered,
the same file loads once per process and every class in it pickles by reference, in the
trainer and in each worker (which loads the file again from the same absolute path).

Invariant: every error is one ``ValueError`` line naming the field (``where``), the spec,
what was wrong and what to do.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import re
import sys
import traceback
from pathlib import Path
from typing import Any



def module_name_for(path: Path) -> str:
    """The ``sys.modules`` name of a user file: stable for a path, distinct across paths."""
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    stem = re.sub(r"\W", "_", path.stem)
    return f"hybridrl_user_{stem}_{digest}"


def split_spec(spec: str, where: str, example: str) -> tuple[str, str]:
    target, _, name = spec.rpartition(":")
    if not target or not name:
        raise ValueError(f"{where}={spec!r}: give {example}")
    return target, name


def load_module(target: str, spec: str, where: str, what: str = "environment"):
    """The module ``target`` (a ``.py`` path or a dotted module name) of user code (``what``:
    a reward, an environment, a tool parser); returns ``(module, absolute path or None)``.
    A file already loaded in this process is reused."""
    if not target.endswith(".py"):
        try:
            with import_errors(spec, where, target, what=what):
                return importlib.import_module(target), None
        except ModuleNotFoundError as e:
            raise ValueError(f"{where}={spec!r}: cannot import {target} ({e}); check the module path") from None
    path = Path(target).resolve()
    if not path.is_file():
        raise ValueError(f"{where}={spec!r}: file {target} not found; check the path (relative to {Path.cwd()})")
    name = module_name_for(path)
    if name in sys.modules:
        return sys.modules[name], path
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before executing it, as import does: dataclasses look their module up
    try:
        with import_errors(spec, where, target, what=what):
            module_spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # a half-executed module must not be reused
        raise
    return module, path


def load_object(spec: str, where: str, example: str) -> tuple[Any, Path | None]:
    """``(object, absolute file path or None for a module spec)`` for ``spec``."""
    if not isinstance(spec, str):
        raise ValueError(f"{where}={spec!r}: give {example}")
    target, name = split_spec(spec, where, example)
    module, path = load_module(target, spec, where)
    obj = getattr(module, name, None)
    if obj is None:
        public = sorted(k for k, v in vars(module).items()
                        if not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        defined = f"it defines {', '.join(public)}" if public else "it defines nothing public"
        raise ValueError(f"{where}={spec!r}: no {name!r} in {target} ({defined}); check the name after ':'")
    return obj, path


@contextlib.contextmanager
def import_errors(spec: str, where: str, target: str, what: str = "reward"):
    """A user module (a ``what``: reward, environment) that fails to import (a syntax error,
    or raising at import time) is one line naming the file and line, not a traceback
    through importlib."""
    try:
        yield
    except ModuleNotFoundError as e:
        if e.name and target.split(".")[0] == e.name.split(".")[0] and not target.endswith(".py"):
            raise  # the module itself (or its package) is missing: the caller says so
        raise ValueError(f"{where}={spec!r}: importing {target} failed: {e}; install it or fix the import") from e
    except SyntaxError as e:  # IndentationError too
        raise ValueError(f"{where}={spec!r}: {e.filename}:{e.lineno}: {type(e).__name__}: {e.msg}; "
                         f"fix the {what} file") from e
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever the module's top level raised
        frame = traceback.extract_tb(e.__traceback__)[-1]
        why = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{where}={spec!r}: importing {target} raised {type(e).__name__}: {why} "
                         f"({frame.filename}:{frame.lineno}); fix the {what} module") from e
