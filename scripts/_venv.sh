# Sourced by scripts/*: create/use .venv and install the project (with the extras in $HURRAY_EXTRAS).
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
extras="${HURRAY_EXTRAS:-}"
stamp="$VENV/.hurray-installed${extras:+-$extras}"
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT${extras:+[$extras]}"
    touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
