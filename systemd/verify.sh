#!/usr/bin/env bash
# `systemd-analyze verify` on every unit in systemd/, as CI runs it: in a container, without a running systemd.
# verify wants ExecStart's executable to exist. The units name the deployed path, /usr/local/bin/shmbroker
# (docs/DEPLOY.md); the copy verified here names this checkout's installed entry point instead, and nothing
# else changes. verify exits 0 after a line it ignored (a value it cannot parse), so any output fails too.
set -euo pipefail
cd "$(dirname "$0")/.."
bin="${SHMBROKER_BIN:-$PWD/.venv/bin/shmbroker}"
[ -x "$bin" ] || { echo "verify.sh: $bin is not installed (make .venv/bin/shmbroker)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for unit in systemd/*.service; do
    copy="$tmp/$(basename "$unit")"
    sed "s|/usr/local/bin/shmbroker|$bin|g" "$unit" > "$copy"
    if ! out=$(systemd-analyze verify "$copy" 2>&1) || [ -n "$out" ]; then
        echo "$unit: $out" >&2
        status=1
    else
        echo "systemd-analyze verify $unit: ok"
    fi
done
exit $status
