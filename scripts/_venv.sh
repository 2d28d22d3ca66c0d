# Sourced by scripts/*: create/use .venv and install the project with its test extras, once for
# every script (scripts/demo then scripts/test installs once). Re-installs only when pyproject.toml
# changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
extras="test${HURRAY_EXTRAS:+,$HURRAY_EXTRAS}"  # scripts/bench adds "bench"
stamp="$VENV/.hurray-installed-${extras//,/-}"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip "setuptools>=77" >/dev/null
    # The filter hides setuptools' one informational note on editable installs (a meta path finder
    # maps broker/ to hurray_ipc.broker); real warnings still show.
    PYTHONWARNINGS="ignore:Editable installation" \
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[$extras]"
    # NIXL for broker/rdma.py and its tests: --no-deps, because nixl-cu12 declares torch (a CUDA
    # build) that it imports only for typing. Tolerant: without it the RDMA tests skip, naming why.
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "nixl-cu12>=1.0" \
        >/dev/null 2>&1 || echo "scripts: nixl-cu12 not installed; the RDMA tests will skip" >&2
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
