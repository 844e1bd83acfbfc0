#!/usr/bin/env bash
# Makes the local base image of deploy/Containerfile: a Debian minbase with Python, from
# Debian's packages (debootstrap), for machines that reach no image registry.
#   deploy/base.sh IMAGE [SUITE] [MIRROR]
set -euo pipefail

image=${1:?usage: deploy/base.sh IMAGE [SUITE] [MIRROR]}
suite=${2:-bookworm}
mirror=${3:-}  # empty: debootstrap's default mirror

rootfs=$(mktemp -d /var/tmp/kvpool-base.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT

echo "debootstrap $suite (minbase + python3) into $rootfs"
debootstrap --variant=minbase --include=python3,python3-venv "$suite" "$rootfs" ${mirror:+"$mirror"} >"$rootfs.log" 2>&1 \
  || { tail -20 "$rootfs.log"; echo "debootstrap failed (log: $rootfs.log)"; exit 1; }
rm -f "$rootfs.log"

# What a slim image leaves out: apt's downloaded packages and lists, documentation
# (the copyright files stay), manual pages and translations. About 140 MB.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* \
  "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
find "$rootfs"/usr/share/doc -type f ! -name copyright -delete
find "$rootfs"/usr/share/doc -type d -empty -delete

tar -C "$rootfs" --numeric-owner -c . | podman import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "made $image: $(podman image inspect --format '{{.Size}}' "$image") bytes"
