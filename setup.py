"""Build hook: compile the hot path with mypyc where a C compiler is present (hurray_ipc/compiled.py).

Everything else about the package is in pyproject.toml. Without a compiler, with HURRAY_COMPILE=0,
or when mypyc fails on this machine, the package installs as pure Python and says so: the compiled
modules are an optimisation of the same source, never a requirement.
"""

from __future__ import annotations

import os
import runpy
import shutil
import sys
import sysconfig

from setuptools import setup


def _ext_modules() -> list:
    if os.environ.get("HURRAY_COMPILE", "1") == "0":
        return []
    compiler = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        print(f"hurray-ipc: no C compiler ({compiler}): installing pure Python", file=sys.stderr)
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        print("hurray-ipc: mypyc is not importable: installing pure Python", file=sys.stderr)
        return []
    here = os.path.dirname(os.path.abspath(__file__))
    paths = runpy.run_path(os.path.join(here, "hurray_ipc", "compiled.py"))["sources"]()
    # Modules the compiled ones import are read for their types (silently: mypy judges them in
    # scripts/test); third-party libraries are Any, whatever the environment holds
    # (--no-site-packages: a venv with torch made mypy read torch for ten minutes).
    # One group: its modules call each other natively, through mypyc's shared library, a top-level
    # extension module named by a hash of the group (<hash>__mypyc; mypyc 1.13 cannot place it in
    # the package: a dotted group name builds a library without its init function).
    exts = mypycify(["--ignore-missing-imports", "--follow-imports=silent", "--no-site-packages", *paths],
                    opt_level="3")
    for ext in exts:
        ext.optional = True  # a C compile that fails leaves the pure module in place (build_ext says why)
    return exts


setup(ext_modules=_ext_modules())
