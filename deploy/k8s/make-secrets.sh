#!/bin/sh
# Writes the values of the Secrets deploy/k8s/base generates (Kustomize secretGenerator), one file
# each under deploy/k8s/base/secrets/ (git-ignored), and keeps any that already exist:
#   redis-password  Redis's requirepass, in every service's Redis URL
#   peer-key        HMAC key of every value the services read back from Redis
#   service-token   what the gateway and LLMs send the encoders and LLMs
#   api-keys        the gateway's client API keys, comma-separated (printed once when made)
# Every Deployment needs them (required secretKeyRefs): run this before `kubectl apply -k`.
#   deploy/k8s/make-secrets.sh                      # random values (openssl rand -hex 32)
#   MMSERVE_API_KEYS=key1,key2 deploy/k8s/make-secrets.sh   # your own client keys
# To rotate one: delete its file, run this again, `kubectl apply -k` (a new Secret name rolls the pods).
set -eu
dir="$(cd "$(dirname "$0")" && pwd)/base/secrets"
mkdir -p "$dir"
umask 077
make() {  # name value: written without a trailing newline (it would become part of the secret)
  if [ -s "$dir/$1" ]; then echo "kept    $dir/$1"; return 1; fi
  printf %s "$2" > "$dir/$1"
  echo "made    $dir/$1"
}
make redis-password "$(openssl rand -hex 32)" || true
make peer-key "$(openssl rand -hex 32)" || true
make service-token "$(openssl rand -hex 32)" || true
if make api-keys "${MMSERVE_API_KEYS:-$(openssl rand -hex 24)}" && [ -z "${MMSERVE_API_KEYS:-}" ]; then
  echo "the gateway's API key (Authorization: Bearer ...): $(cat "$dir/api-keys")"
fi
