#!/usr/bin/env bash
# Build the `swe` domains' Docker image offline: Debian bookworm minbase with python3, git and
# pytest (the swe_rebench grader runs the instances' pytest suites with it), made by
# debootstrap from the apt mirror and imported (no image registry is needed).
# Cached: does nothing when the image already exists with pytest in it (an image built before
# pytest was added is rebuilt). Needs root and a running dockerd.
#   usage: scripts/swe-docker-image.sh [IMAGE]      (default evotrainer-swe:bookworm)
#   env:   SWE_DEBIAN_MIRROR (default: the mirror apt already uses, else deb.debian.org)
set -euo pipefail

image="${1:-evotrainer-swe:bookworm}"
if docker image inspect "$image" >/dev/null 2>&1 \
        && docker run --rm --network none "$image" python3 -c "import pytest" >/dev/null 2>&1; then
    echo "swe image $image: cached"
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install -y debootstrap)" >&2; exit 1; }

mirror="${SWE_DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
    mirror="$(grep -hoE '^(deb|URIs:) +[^ ]*' /etc/apt/sources.list /etc/apt/sources.list.d/* 2>/dev/null \
        | awk '{print $2}' | grep -m1 -E '^https?://' || true)"
    mirror="${mirror:-http://deb.debian.org/debian}"
fi

rootfs="$(mktemp -d /var/tmp/evotrainer-swe-rootfs.XXXXXX)"
trap 'rm -rf "$rootfs"' EXIT
start=$SECONDS
debootstrap --variant=minbase --include=python3,git,python3-pytest bookworm "$rootfs" "$mirror" >/dev/null
# A default identity, so `git commit` inside an episode works as it does in the local executor.
chroot "$rootfs" git config --system user.name agent
chroot "$rootfs" git config --system user.email agent@localhost
chroot "$rootfs" git config --system init.defaultBranch main
tar -C "$rootfs" -c . | docker import - "$image" >/dev/null
echo "swe image $image: built in $((SECONDS - start)) s"
