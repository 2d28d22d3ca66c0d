"""The compiled hot path and its pure fallback (hurray_ipc/compiled.py): which one a process runs."""

from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys

import pytest

from hurray_ipc import compiled


def _status(**env: str) -> dict[str, str]:
    code = "import json, hurray_ipc.compiled as c; print(json.dumps(c.status()))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out)


def test_hurray_pure_runs_the_source_of_every_compiled_module():
    assert _status(HURRAY_PURE="1") == {name: "pure" for name in compiled.COMPILED}


@pytest.mark.skipif("compiled" not in compiled.status().values(), reason="installed without a C compiler or with "
                    "HURRAY_COMPILE=0: no extension module to run")
def test_an_installed_extension_runs_unless_told_otherwise():
    assert _status(HURRAY_PURE="0") == {name: "compiled" for name in compiled.COMPILED}


def _module_pair(tmp_path, leaf: str, source_age: int, built_age: int | None) -> None:
    src = tmp_path / f"{leaf}.py"
    src.write_text("")
    os.utime(src, (1e9 - source_age, 1e9 - source_age))
    if built_age is not None:
        ext = tmp_path / f"{leaf}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
        ext.write_bytes(b"")
        os.utime(ext, (1e9 - built_age, 1e9 - built_age))


def test_an_extension_older_than_its_source_is_stale(tmp_path):
    _module_pair(tmp_path, "edited", source_age=10, built_age=100)  # source edited after the build
    _module_pair(tmp_path, "fresh", source_age=100, built_age=10)
    _module_pair(tmp_path, "never_built", source_age=10, built_age=None)
    assert compiled._stale(str(tmp_path), "edited")
    assert not compiled._stale(str(tmp_path), "fresh")
    assert not compiled._stale(str(tmp_path), "never_built")


def test_the_finder_hands_out_sources_only_when_pure(tmp_path):
    name = compiled.COMPILED[0]
    leaf = name.rpartition(".")[2]
    _module_pair(tmp_path, leaf, source_age=100, built_age=10)
    finder = compiled._SourceFinder(pure=False)
    finder.pure = True
    spec = finder.find_spec(name, [str(tmp_path)])
    assert spec is not None and spec.origin == str(tmp_path / f"{leaf}.py")
    finder.pure = False
    assert finder.find_spec(name, [str(tmp_path)]) is None  # the default finder picks the extension
    assert compiled._SourceFinder(pure=True).find_spec("hurray_ipc.wire.ipc", [str(tmp_path)]) is None  # not compiled


_CHECK_INITS = """
import dataclasses, inspect
from hurray_ipc.broker import core
from hurray_ipc.wire import ipc
written = [cls for m in (core, ipc) for cls in vars(m).values()
           if dataclasses.is_dataclass(cls) and cls.__module__ == m.__name__ and not cls.__dataclass_params__.init
           and "__init__" in vars(cls)]
assert len(written) >= 11, [c.__name__ for c in written]
for cls in written:
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    fields = dataclasses.fields(cls)
    by_name = {p.name: p for p in params}
    assert set(by_name) == {f.name for f in fields}, (cls.__name__, set(by_name) ^ {f.name for f in fields})
    positional = [p.name for p in params if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    assert positional == [f.name for f in fields if not f.kw_only], (cls.__name__, positional)
    for f in fields:
        p = by_name[f.name]
        assert (p.kind is inspect.Parameter.KEYWORD_ONLY) == f.kw_only, (cls.__name__, f.name)
        want = inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default
        assert p.default == want, (cls.__name__, f.name, p.default, want)
    # Each field gets its own argument: built with a distinct object per field, each is where it belongs.
    marks = {f.name: object() for f in fields}
    obj = cls(*[marks[n] for n in positional], **{f.name: marks[f.name] for f in fields if f.kw_only})
    wrong = [f.name for f in fields if getattr(obj, f.name) is not marks[f.name]]
    assert not wrong, (cls.__name__, wrong)
print("ok")
"""


def test_each_written_init_takes_exactly_its_dataclass_fields():
    """The per-handoff records spell out their __init__ (mypyc compiles a written one, not one
    @dataclass generates): each must take every field, by the same name, position, kind and
    default, and store each argument in its own field. Every dataclass of the compiled modules
    with a written __init__ is checked, from the source (HURRAY_PURE=1): a compiled __init__ shows
    no signature."""
    out = subprocess.run([sys.executable, "-c", _CHECK_INITS], env={**os.environ, compiled.PURE_ENV: "1"},
                         capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
