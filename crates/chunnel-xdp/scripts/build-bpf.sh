#!/usr/bin/env bash
# Builds the XDP program outside cargo (build.rs does the same when clang is present), e.g.
# for Config::bpf_object on a binary built without clang.
# Usage: scripts/build-bpf.sh OUT.o
# Needs: clang and the kernel UAPI headers (Debian: apt-get install clang; linux-libc-dev is
# already there with libc6-dev).
set -euo pipefail
[ $# -eq 1 ] || { echo "usage: $0 OUT.o" >&2; exit 2; }
out=$(realpath -m "$1")
cd "$(dirname "$0")/.."
inc=()
multiarch="/usr/include/$(uname -m)-linux-gnu"
[ -d "$multiarch" ] && inc=(-I"$multiarch")
"${CLANG:-clang}" -O2 -g -target bpf -Wall "${inc[@]}" -c bpf/xdp_udp_steer.c -o "$out"
echo "$out"
