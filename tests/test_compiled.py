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
