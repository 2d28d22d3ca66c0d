"""The package's layers import only downward (docs/ARCHITECTURE.md): read from every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "hurray_ipc"
# Bottom to top; one rank may import any lower rank. The top rank's packages (the service and the
# tools) may use one another.
RANKS = [["errors", "notes", "compiled", "units"], ["format"], ["contract"], ["wire"], ["devices"], ["transport"],
         ["interchange", "interop"], ["client"], ["broker", "bench", "cli", "workload", "demo", "__main__"]]
RANK = {name: i for i, names in enumerate(RANKS) for name in names}


def _imported(path: Path, root: Path = PKG) -> set[str]:
    """The top-level subpackages of hurray_ipc (whose source is at ``root``) that ``path`` imports."""
    rel = path.relative_to(root).parts
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            full = list(rel[:-1])[:len(rel) - node.level] + (node.module.split(".") if node.module else [])
            if full:
                out.add(full[0])
            else:  # from .. import x, y: the names are the subpackages
                out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "hurray_ipc":  # from hurray_ipc import client
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hurray_ipc."):
            out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("hurray_ipc."))
    return {m.removesuffix(".py") for m in out}


def test_every_package_imports_only_the_layers_below_it():
    upward = []
    for path in sorted(PKG.rglob("*.py")):
        pkg = path.relative_to(PKG).parts[0].removesuffix(".py")
        if pkg == "__init__":
            continue
        assert pkg in RANK, f"{pkg} is in no layer: add it to RANKS and to docs/ARCHITECTURE.md"
        for m in _imported(path) - {pkg}:
            if m in RANK and RANK[m] >= RANK[pkg] and RANK[pkg] < len(RANKS) - 1:
                upward.append(f"{path.relative_to(PKG)} imports {m}")
    assert not upward, upward


def test_the_check_sees_an_upward_import(tmp_path):
    """The reader above is not vacuous: a relative and an absolute upward import are both found."""
    (tmp_path / "wire").mkdir()
    probe = tmp_path / "wire" / "probe.py"
    probe.write_text("from ..client import session\nimport hurray_ipc.devices.cpu\nfrom . import fields\n"
                     "from hurray_ipc import transport\n")
    assert _imported(probe, tmp_path) == {"client", "devices", "wire", "transport"}
