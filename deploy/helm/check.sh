#!/usr/bin/env bash
# `make k8s-check`: the Helm chart checked without a cluster.
#
#   1. helm lint --strict, with the default values and with each deploy/helm/examples/*.yaml;
#   2. helm template (hooks included) with the same values, into $OUT/<name>.yaml;
#   3. kubeconform -strict on every rendered manifest, against the Kubernetes $K8S_VERSION schemas
#      and the CRD schemas of KEDA (ScaledObject, TriggerAuthentication) and the Prometheus
#      Operator (ServiceMonitor); a kind without a schema fails.
#
# The tools come from deploy/helm/tools.sh (make install runs it). Exit 0: all valid; 1: a check
# failed; 3: the tools are not installed (the reason on stderr).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
eval "$(deploy/helm/tools.sh --env)"
CHART=deploy/helm/inferline
OUT=${K8S_CHECK_OUT:-$ROOT/.cache/k8s-check}

for need in "$HELM" "$KUBECONFORM" "$K8S_SCHEMAS/.complete" "$CRD_SCHEMAS/.complete"; do
    if [ ! -e "$need" ]; then
        echo "k8s-check: $need is missing: run deploy/helm/tools.sh (make install does)" >&2
        exit 3
    fi
done

rm -rf "$OUT" && mkdir -p "$OUT"
render() {  # render NAME [VALUES_FILE]
    local name=$1; shift
    local args=()
    [ $# -gt 0 ] && args=(-f "$1")
    "$HELM" lint --strict "$CHART" "${args[@]}" --kube-version "$K8S_VERSION" >"$OUT/$name.lint" 2>&1 \
        || { cat "$OUT/$name.lint" >&2; echo "k8s-check: helm lint failed ($name)" >&2; return 1; }
    "$HELM" template inferline "$CHART" "${args[@]}" --namespace inferline \
        --kube-version "$K8S_VERSION" >"$OUT/$name.yaml"
    echo "k8s-check: $name: lint ok, $(grep -c '^kind:' "$OUT/$name.yaml") manifests"
}

render default
for values in deploy/helm/examples/*.yaml; do
    render "$(basename "$values" .yaml)" "$values"
done

"$KUBECONFORM" -strict -summary -kubernetes-version "$K8S_VERSION" \
    -schema-location "$K8S_SCHEMAS/{{ .ResourceKind }}{{ .KindSuffix }}.json" \
    -schema-location "$CRD_SCHEMAS/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json" \
    "$OUT"/*.yaml
