#!/usr/bin/env bash
# Makes the Secrets that the dev overlay mounts, in the namespace airlock of the
# current kubectl context:
#   airlock-tls-<component>   tls.crt, tls.key, ca.crt from `airlock certs init`
#   airlock-principals        agent-token, approver-token (random)
#   airlock-store             password (random; the store's role, and PostgreSQL's)
#   airlock-databases         sandbox-password (random; the db worker's role)
# Safe to run again: existing tokens and passwords are kept, and certificates until
# they near their expiry.
#
#   deploy/k8s/overlays/dev/secrets.sh [CERT_DIR]   (default ./airlock-dev-certs)
#
# Needs kubectl, openssl, and the airlock binary (AIRLOCK=/path/to/airlock, or on PATH;
# `docker run --rm -v "$PWD/airlock-dev-certs:/out" airlock:dev certs init --out /out
# --san ...` with the same --san flags writes the same files).
set -euo pipefail

ns=airlock
certs=${1:-./airlock-dev-certs}
certs=${certs%/}
airlock=${AIRLOCK:-airlock}
components=(orchestrator worker-shell worker-fs worker-http worker-db)

kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -

# Certificates that expire within AIRLOCK_DEV_CERT_RENEW_DAYS (default 30; the leaves
# live a year, the CA five) or that openssl cannot read are made again, all of them with
# a new CA, after the old directory is moved aside: a dev cluster left running for a year
# would otherwise be handed its expired certificates again, and every TLS hop would fail.
renew_days=${AIRLOCK_DEV_CERT_RENEW_DAYS:-30}
if [ -e "$certs/ca.crt" ]; then
  for c in ca "${components[@]}"; do
    if ! openssl x509 -noout -checkend "$((renew_days * 86400))" -in "$certs/$c.crt" >/dev/null 2>&1; then
      old="$certs.old-$(date -u +%Y%m%dT%H%M%SZ)"
      mv "$certs" "$old"
      echo "$c.crt expires within $renew_days days (or cannot be read): new certificates replace those now in $old;" \
        "restart the pods to load them: kubectl -n $ns rollout restart deployment,statefulset" >&2
      break
    fi
  done
fi
if [ ! -e "$certs/ca.crt" ]; then
  # Each certificate carries its component's name (what the peers check); the
  # orchestrator's also these: the front door's Service names, for clients of the TLS
  # gRPC port.
  "$airlock" certs init --out "$certs" \
    --san airlock-orchestrator.airlock.svc.cluster.local \
    --san airlock-orchestrator.airlock.svc \
    --san localhost
fi
for c in "${components[@]}"; do
  kubectl -n "$ns" create secret generic "airlock-tls-$c" \
    --from-file=tls.crt="$certs/$c.crt" \
    --from-file=tls.key="$certs/$c.key" \
    --from-file=ca.crt="$certs/ca.crt" \
    --dry-run=client -o yaml | kubectl apply -f -
done

# A Secret that exists is left alone, so tokens and passwords survive a second run.
# Values go through files in a private directory, never on a command line (which any
# local user can read in /proc/<pid>/cmdline).
secrets_tmp=$(umask 077 && mktemp -d)
trap 'rm -rf "$secrets_tmp"' EXIT
random() { (umask 077 && openssl rand -hex 32 | tr -d '\n' >"$secrets_tmp/$1") && echo "$secrets_tmp/$1"; }
create_once() {
  local name=$1
  shift
  if kubectl -n "$ns" get secret "$name" >/dev/null 2>&1; then
    echo "secret/$name kept"
  else
    kubectl -n "$ns" create secret generic "$name" "$@"
  fi
}
create_once airlock-principals \
  --from-file=agent-token="$(random agent-token)" \
  --from-file=approver-token="$(random approver-token)"
create_once airlock-store --from-file=password="$(random password)"
create_once airlock-databases --from-file=sandbox-password="$(random sandbox-password)"

cat <<MSG
Secrets are in namespace $ns. The agent's token:
  kubectl -n $ns get secret airlock-principals -o jsonpath='{.data.agent-token}' | base64 -d
Next: kubectl apply -k deploy/k8s/overlays/dev
MSG
