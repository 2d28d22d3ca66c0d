"""Which modules run compiled, chosen once, here (as pyzmq chooses its backend in one place).

The hot path's pure-Python modules in :data:`COMPILED` are compiled with mypyc when the package is
installed on a machine with a C compiler (``setup.py``; ``HURRAY_COMPILE=0`` at install skips it);
the same ``.py`` files stay beside the extension modules and are the fallback. The compiled module
and its source are one program: mypyc compiles the annotated source as it is, so the test suite,
the vectors and the sync mutants judge both.

``HURRAY_PURE=1`` in the environment of a process makes it import the pure-Python source of every
module in :data:`COMPILED` even where an extension module was built (``scripts/test`` runs the
core's tests that way after the whole suite; a debugger or a profiler sees Python frames). A
process reads it once, when ``hurray_ipc`` is first imported. An extension module older than its
source never runs: the source does (``scripts/_venv.sh`` rebuilds when a compiled module's source
changed).

This module is a leaf (standard library only): ``setup.py`` reads :data:`COMPILED` from it before
the package is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["COMPILED", "PURE_ENV", "status"]

# The broker's per-handoff dispatch (HANDOFF in, DELIVER out; RELEASE in, RELEASED and GRANT out),
# its queries, and the binary codec of the hot verbs that the broker and both clients run per
# handoff. Each entry must compile with mypyc and import only what its annotations name.
# The clients are not here: compiled, they ran 0.87x (producer) and 0.92x (consumer) their pure
# CPU, and mypyc's argument checks would answer a user's bad argument with a bare TypeError
# instead of InvalidArgument (docs/benchmarks.md, "the clients compiled: measured, not taken").
# In these modules a class built per handoff writes out its __init__: mypyc compiles a written one
# but leaves the one @dataclass generates interpreted (tests/test_compiled.py checks they match).
# Compiled, such a class cannot be copied or pickled (mypyc's tp_new calls that __init__ with no
# arguments); nothing does either to them.
COMPILED: tuple[str, ...] = ("hurray_ipc.broker.core", "hurray_ipc.broker.queries", "hurray_ipc.wire.ipc")
PURE_ENV = "HURRAY_PURE"


class _SourceFinder(importlib.abc.MetaPathFinder):
    """Finds the modules of :data:`COMPILED` as their ``.py`` source where their extension modules
    must not run: ``pure``, or one of them is older than its source (an editable install whose
    source was edited since it was built: the extension is another program now). All or none: they
    are compiled as one group whose modules call each other natively. Elsewhere it leaves them to
    the default path finder, which prefers the extension."""

    def __init__(self, pure: bool):
        package = os.path.dirname(os.path.abspath(__file__))
        self.pure = pure or any(_stale(os.path.join(package, *name.split(".")[1:-1]), name.rpartition(".")[2])
                                for name in COMPILED)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED or not path:
            return None
        leaf = fullname.rpartition(".")[2]
        for folder in path:
            source = os.path.join(folder, leaf + ".py")
            if os.path.isfile(source):
                if self.pure:
                    return importlib.util.spec_from_file_location(fullname, source)
                return None
        return None


def _stale(folder: str, leaf: str) -> bool:
    """Whether module ``leaf`` in ``folder`` has an extension module older than its source."""
    source = os.path.join(folder, leaf + ".py")
    built = [os.path.join(folder, leaf + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    mtimes = [os.stat(b).st_mtime for b in built if os.path.isfile(b)]
    return bool(mtimes) and os.path.isfile(source) and max(mtimes) < os.stat(source).st_mtime


def sources(root: str = "") -> list[str]:
    """The source file of each module of :data:`COMPILED`, under project root ``root`` (default:
    relative to it)."""
    return [os.path.join(root, *name.split(".")) + ".py" for name in COMPILED]


def status() -> dict[str, str]:
    """Each module of :data:`COMPILED`: ``"compiled"`` (its extension module runs) or ``"pure"``
    (its Python source runs). Imports them."""
    out = {}
    for name in COMPILED:
        module = importlib.import_module(name)
        origin = getattr(module, "__file__", "") or ""
        out[name] = "pure" if origin.endswith(".py") else "compiled"
    return out


if __name__ == "__main__":  # scripts/_venv.sh: which sources a rebuild follows
    print("\n".join(sources(sys.argv[1] if len(sys.argv) > 1 else ".")))
elif not any(isinstance(f, _SourceFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _SourceFinder(os.environ.get(PURE_ENV, "") not in ("", "0")))
