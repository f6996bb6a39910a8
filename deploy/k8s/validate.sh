#!/usr/bin/env bash
# Renders every overlay (and production with components/shell-strict) into a temp dir
# and checks what comes out:
#   - kubernetes-validate: every object against the OpenAPI schemas of Kubernetes
#     $K8S_VERSION, strict (an unknown field is an error). Kinds without a bundled
#     schema (cert-manager's) are listed and checked by checkov only.
#   - checkov: its Kubernetes checks; a failed check fails the run unless the object
#     skips it inline (checkov.io/skipN: CKV_K8S_xx=reason).
#
#   deploy/k8s/validate.sh
#
# Needs kubectl with kustomize v5 (or kustomize v5 on PATH), kubernetes-validate and
# checkov (PyPI; .ci/run installs both in a virtualenv, AIRLOCK_K8S_VENV).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
K8S_VERSION=${K8S_VERSION:-1.35.0}
venv=${AIRLOCK_K8S_VENV:-}
if [ -n "$venv" ]; then
  PATH="$venv/bin:$PATH"
fi

# --- tools -------------------------------------------------------------------------
if command -v kustomize >/dev/null 2>&1 && kustomize version 2>/dev/null | grep -q '^v5'; then
  render() { kustomize build "$1"; }
elif command -v kubectl >/dev/null 2>&1 \
  && kubectl version --client 2>/dev/null | grep -q 'Kustomize Version: v5'; then
  render() { kubectl kustomize "$1"; }
else
  echo "deploy/k8s/validate.sh: needs kustomize v5: kubectl 1.27 or later (it embeds kustomize v5; Debian's kubernetes-client 1.20 embeds v2, too old for components and labels), or kustomize v5 on PATH (go install sigs.k8s.io/kustomize/kustomize/v5@v5.5.0)" >&2
  exit 1
fi
for tool in kubernetes-validate checkov; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "deploy/k8s/validate.sh: $tool is missing: python3 -m pip install kubernetes-validate checkov (or set AIRLOCK_K8S_VENV to a virtualenv that has them)" >&2
    exit 1
  fi
done

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# --- render ------------------------------------------------------------------------
# production + shell-strict: a throwaway overlay, as a site would write it (kustomize
# takes only relative paths).
mkdir -p "$out/production-strict"
rel=$(realpath --relative-to="$out/production-strict" "$here")
cat > "$out/production-strict/kustomization.yaml" <<YAML
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - $rel/overlays/production
components:
  - $rel/components/shell-strict
YAML

declare -A sources=(
  [dev]="$here/overlays/dev"
  [production]="$here/overlays/production"
  [production-strict]="$out/production-strict"
)
names=(dev production production-strict)
for name in "${names[@]}"; do
  mkdir -p "$out/rendered/$name"
  if ! render "${sources[$name]}" > "$out/rendered/$name/all.yaml"; then
    echo "FAIL: $name does not render" >&2
    exit 1
  fi
  echo "== $name renders: $(grep -c '^kind:' "$out/rendered/$name/all.yaml") objects"
done

# --- schemas -------------------------------------------------------------------------
# One file per object, so that a kind without a schema can be set aside by name.
python3 - "$out/rendered" <<'PY'
import pathlib, sys, yaml
root = pathlib.Path(sys.argv[1])
for overlay in sorted(p for p in root.iterdir() if p.is_dir()):
    docs = [d for d in yaml.safe_load_all((overlay / "all.yaml").read_text()) if d]
    for i, doc in enumerate(docs):
        group = doc["apiVersion"].split("/")[0] if "/" in doc["apiVersion"] else "core"
        sub = "crd" if group.endswith("cert-manager.io") else "k8s"
        (overlay / sub).mkdir(exist_ok=True)
        name = f'{i:03d}-{doc["kind"]}-{doc["metadata"]["name"]}.yaml'
        (overlay / sub / name).write_text(yaml.safe_dump(doc))
PY
status=0
for name in "${names[@]}"; do
  dir="$out/rendered/$name"
  echo "== kubernetes-validate $name (Kubernetes $K8S_VERSION, strict)"
  if ! kubernetes-validate --quiet --strict -k "$K8S_VERSION" "$dir"/k8s/*.yaml; then
    echo "FAIL: $name has objects that do not match the Kubernetes $K8S_VERSION schemas" >&2
    status=1
  fi
  if [ -d "$dir/crd" ]; then
    echo "   (no bundled schema, checked by checkov only: $(ls "$dir/crd" | sed 's/^[0-9]*-//; s/\.yaml$//' | tr '\n' ' '))"
  fi
done

# --- checkov -------------------------------------------------------------------------
for name in "${names[@]}"; do
  echo "== checkov $name"
  if ! checkov --quiet --compact --framework kubernetes --skip-download \
      --file "$out/rendered/$name/all.yaml" > "$out/checkov-$name.txt" 2>&1; then
    cat "$out/checkov-$name.txt"
    echo "FAIL: checkov found failed checks in $name (fix them, or skip one inline with a reason: checkov.io/skipN: CKV_K8S_xx=why)" >&2
    status=1
  else
    grep -E '^(Passed|kubernetes scan)' "$out/checkov-$name.txt" || tail -n 3 "$out/checkov-$name.txt"
  fi
done

# --- the CA keeps its key ----------------------------------------------------------
# Every pod trusts only its own Secret's ca.crt: a CA renewed with a new key splits the
# components in two until every leaf is renewed (see overlays/production/certificates.yaml).
for name in production production-strict; do
  if ! python3 - "$out/rendered/$name/all.yaml" <<'PY'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
cas = [d for d in docs if d["kind"] == "Certificate" and d["spec"].get("isCA")]
bad = [d["metadata"]["name"] for d in cas
       if d["spec"].get("privateKey", {}).get("rotationPolicy") != "Never"]
if not cas or bad:
    print(f"CA certificates {bad or 'missing'} must keep their key (privateKey.rotationPolicy: Never)")
    sys.exit(1)
PY
  then
    echo "FAIL: $name renews its CA with a new key" >&2
    status=1
  fi
done

# --- the dev overlay's secrets never pass through a command line ------------------------
# secrets.sh against stand-ins for kubectl and airlock that log their arguments: no
# generated value (64 hex digits) may be among them, where /proc/<pid>/cmdline shows it.
stubs="$out/stubs"
mkdir -p "$stubs"
cat > "$stubs/kubectl" <<'SH'
#!/bin/sh
printf '%s\n' "$*" >> "$ARGV_LOG"
case "$*" in
  *" get secret "*) exit 1 ;;
  *"apply -f -"*) cat > /dev/null ;;
esac
SH
cat > "$stubs/airlock" <<'SH'
#!/bin/sh
printf '%s\n' "$*" >> "$ARGV_LOG"
out=$4
mkdir -p "$out"
for f in ca orchestrator worker-shell worker-fs worker-http worker-db; do
  : > "$out/$f.crt"; : > "$out/$f.key"
done
SH
chmod +x "$stubs/kubectl" "$stubs/airlock"
echo "== dev secrets.sh keeps values off command lines"
if ! ARGV_LOG="$out/argv.log" PATH="$stubs:$PATH" AIRLOCK="$stubs/airlock" \
    "$here/overlays/dev/secrets.sh" "$out/dev-certs" > "$out/secrets.txt" 2>&1; then
  cat "$out/secrets.txt"
  echo "FAIL: overlays/dev/secrets.sh failed against the stand-ins" >&2
  status=1
elif ! grep -q 'create secret generic airlock-principals' "$out/argv.log"; then
  cat "$out/argv.log"
  echo "FAIL: overlays/dev/secrets.sh did not create the principals' Secret" >&2
  status=1
elif grep -E '[0-9a-f]{64}' "$out/argv.log"; then
  echo "FAIL: overlays/dev/secrets.sh put a generated secret on a command line (above)" >&2
  status=1
fi

# --- the dev overlay's certificates are made again as they near their expiry ------------
# Real certificates that live two days: kept when renewal looks one day ahead, made
# again (the old directory moved aside) when it looks thirty days ahead.
echo "== dev secrets.sh renews certificates that near their expiry"
near="$out/near-certs"
mkdir -p "$near"
for f in ca orchestrator worker-shell worker-fs worker-http worker-db; do
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj "/CN=$f" -keyout "$near/$f.key" -out "$near/$f.crt" >/dev/null 2>&1
done
renewals() { grep -c '^certs init' "$out/argv-renew.log" 2>/dev/null || true; }
: > "$out/argv-renew.log"
if ! ARGV_LOG="$out/argv-renew.log" PATH="$stubs:$PATH" AIRLOCK="$stubs/airlock" AIRLOCK_DEV_CERT_RENEW_DAYS=1 \
    "$here/overlays/dev/secrets.sh" "$near" > "$out/renew.txt" 2>&1 || [ "$(renewals)" != 0 ]; then
  cat "$out/renew.txt" "$out/argv-renew.log"
  echo "FAIL: overlays/dev/secrets.sh made again certificates valid for longer than its window" >&2
  status=1
elif ! ARGV_LOG="$out/argv-renew.log" PATH="$stubs:$PATH" AIRLOCK="$stubs/airlock" AIRLOCK_DEV_CERT_RENEW_DAYS=30 \
    "$here/overlays/dev/secrets.sh" "$near" > "$out/renew.txt" 2>&1 || [ "$(renewals)" != 1 ]; then
  cat "$out/renew.txt" "$out/argv-renew.log"
  echo "FAIL: overlays/dev/secrets.sh kept certificates that expire within its window" >&2
  status=1
elif ! ls -d "$near".old-* >/dev/null 2>&1 || ! grep -q 'rollout restart' "$out/renew.txt"; then
  cat "$out/renew.txt"
  echo "FAIL: overlays/dev/secrets.sh did not keep the old certificates aside or say to restart" >&2
  status=1
fi

if [ "$status" -ne 0 ]; then
  exit "$status"
fi
echo "== every overlay renders and validates"
