#!/usr/bin/env bash
# strangers.sh — strangers at every port of a TLS job are refused.
#
# Starts a 2-rank transformer job under ddprun with mutual TLS (store and data plane, the
# data plane forced onto TCP), finds every TCP port the job listens on (ss -ltnp: ddprun's
# store, rank 0's gloo listener), and throws strangers at each: 4 KiB of random bytes, a TLS
# client without a certificate, a TLS client with another CA's certificate; at the store a
# client with the job's certificate but a wrong token / no token, a 1 MiB key and a 100 MiB
# value. Each must be refused and logged, and the job must finish with the same
# params_crc32 on both ranks.
#
# usage: scripts/strangers.sh [STEPS]    (run from the repository root; needs ss)
set -euo pipefail
steps=${1:-60}
tmp=$(mktemp -d /tmp/goddp-strangers.XXXXXX)
trap 'kill $job_pid 2>/dev/null || true; rm -rf "$tmp"' EXIT
job_pid=

echo "== building into $tmp/bin"
mkdir -p "$tmp/bin"
go build -o "$tmp/bin/ddprun" ./cmd/ddprun
go build -o "$tmp/bin/transformer" ./examples/transformer
go build -o "$tmp/bin/strangers" ./scripts/strangers
"$tmp/bin/strangers" certs "$tmp/pki"
pki=$tmp/pki/job

echo "== starting the job (2 ranks, mutual TLS, gloo over TCP+TLS, $steps steps)"
GODDP_GLOO_TRANSPORT=tcp "$tmp/bin/ddprun" --standalone --nproc_per_node 2 \
	--tls_cert "$pki/node.crt" --tls_key "$pki/node.key" --tls_ca "$pki/ca.crt" --tls_mtls \
	"$tmp/bin/transformer" -- --bench_steps "$steps" --warmup_steps 1 --log_every 10 \
	--log_level warn >"$tmp/job.log" 2>&1 &
job_pid=$!

# The job's listening ports: ddprun's (the store) and its ranks' (gloo).
store_port= data_ports=
for _ in $(seq 1 300); do
	store_port=$(ss -ltnpH | awk -v p="pid=$job_pid," '$0 ~ p {n=split($4,a,":"); print a[n]}' | head -1)
	ranks=$(pgrep -P "$job_pid" -d'|' transformer || true)
	if [ -n "$ranks" ]; then
		data_ports=$(ss -ltnpH | grep -E "pid=($ranks)," | awk '{n=split($4,a,":"); print a[n]}' | sort -u | tr "\n" " " || true)
	fi
	if [ -n "$store_port" ] && [ -n "$data_ports" ]; then break; fi
	if ! kill -0 "$job_pid" 2>/dev/null; then echo "job ended early:"; cat "$tmp/job.log"; exit 1; fi
	sleep 0.1
done
echo "== listening: store $store_port (ddprun pid $job_pid), gloo ${data_ports:-none} (ranks ${ranks//|/ })"
ss -ltnp | grep -E "pid=($job_pid|$ranks)," || true
[ -n "$store_port" ] && [ -n "$data_ports" ] || { echo "ports not found"; cat "$tmp/job.log"; exit 1; }

echo "== strangers"
status=0
# shellcheck disable=SC2086
"$tmp/bin/strangers" attack "$tmp/pki" "$store_port" $data_ports || status=1
if command -v nc >/dev/null; then
	for p in $store_port $data_ports; do
		head -c 4096 /dev/urandom | nc -w 2 127.0.0.1 "$p" >/dev/null 2>&1 || true
		echo "STRANGER port $p: nc: 4 KiB of /dev/urandom sent"
	done
fi

echo "== waiting for the job"
if wait "$job_pid"; then code=0; else code=$?; fi
job_pid=
echo "== job exit code $code"
crcs=$(grep -o 'params_crc32[ =:]*[0-9a-fx]*' "$tmp/job.log" | sort | uniq -c || true)
echo "$crcs"
echo "== refusals in the job's log"
grep -iE 'refused' "$tmp/job.log" | sed -E 's/^(.{300}).*/\1.../' || true
n_store=$(grep -c 'store: refused' "$tmp/job.log" || true)
n_gloo=$(grep -c 'gloo: refused' "$tmp/job.log" || true)
echo "== $n_store store refusals, $n_gloo gloo refusals logged"
if [ "$code" -ne 0 ]; then echo "FAIL: the job failed"; tail -30 "$tmp/job.log"; exit 1; fi
if [ "$(echo "$crcs" | grep -c params_crc32)" -ne 1 ]; then echo "FAIL: ranks disagree or no params_crc32"; exit 1; fi
if [ "$status" -ne 0 ] || [ "$n_store" -eq 0 ] || [ "$n_gloo" -eq 0 ]; then echo "FAIL: a stranger was let in or not logged"; exit 1; fi
echo "OK: every stranger refused and logged; the job finished, both ranks with the same parameters"
