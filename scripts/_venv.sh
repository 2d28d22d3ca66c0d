# Sourced by scripts/*: create/use .venv and install the project (editable) with what the script
# needs: the extras in `script_extras` (set before sourcing; comma-separated, "+nixl" is nixl-cu12
# without its dependencies), the user's HURRAY_EXTRAS, and the cuda12/cuda13 extra that fits the
# NVIDIA driver (none without one: CPU and the CUDA emulation need no CUDA package). The stamp
# records what is installed; a script re-installs only when it needs more or pyproject.toml changed
# since (then all of it again), so scripts/demo then scripts/test installs twice (the test extras
# are new) and scripts/test then scripts/demo once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
# The driver's extra: hurray_ipc/devices/backend/driver.py (stdlib only, so it runs before anything
# is installed) is the one detection, shared with hurray-caps --install-hint and scripts/gpu-check.
# Without a driver: the script's script_cuda_without_driver (scripts/test: the tests use the enums).
gpu_extra="$("$VENV/bin/python" "$ROOT/hurray_ipc/devices/backend/driver.py" extra)"
gpu_extra="${gpu_extra:-${script_cuda_without_driver:-}}"
stamp="$VENV/.hurray-installed"
have="$(cat "$stamp" 2>/dev/null || true)"
# Wanted: what is installed (another CUDA extra than the driver's is replaced, never kept: the two
# conflict), what the script and HURRAY_EXTRAS ask for, the driver's extra. Sorted, comma-separated.
installed="${have//,/ }"
if [ -n "$gpu_extra" ]; then
    installed="$(printf '%s\n' $installed | sed '/^cuda[0-9]*$/d')"
fi
all="$(printf '%s\n' $installed ${script_extras:-} ${HURRAY_EXTRAS:-} $gpu_extra | tr ',' '\n' | sed '/^$/d' \
       | sort -u | paste -sd, -)"
# The compiled modules (hurray_ipc/compiled.py) are rebuilt when their source changed: an extension
# older than its source is not run (the source is), so without the rebuild tests judge the fallback.
stale=""
for src in $("$VENV/bin/python" "$ROOT/hurray_ipc/compiled.py" "$ROOT"); do
    if [ -f "$stamp" ] && [ "$src" -nt "$stamp" ]; then stale=1; fi
done
if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ] || [ "$ROOT/setup.py" -nt "$stamp" ] \
        || [ -n "$stale" ] || [ "$all" != "$have" ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip "setuptools>=77" >/dev/null
    extras="$(printf '%s\n' ${all//,/ } | sed '/^+/d' | paste -sd, -)"
    # The filter hides setuptools' one informational note on editable installs; real warnings show.
    PYTHONWARNINGS="ignore:Editable installation" \
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT${extras:+[$extras]}"
    if [[ ",$all," == *",+nixl,"* ]]; then
        # NIXL for hurray_ipc/broker/rdma.py and its tests: --no-deps, because nixl-cu12 declares torch (a CUDA
        # build) that it imports only for typing. Tolerant: without it the RDMA tests skip, naming why.
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "nixl-cu12>=1.0" \
            >/dev/null 2>&1 || echo "scripts: nixl-cu12 not installed; the RDMA tests will skip" >&2
    fi
    printf '%s\n' "$all" >"$stamp"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
