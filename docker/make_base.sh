#!/usr/bin/env bash
# A Debian base image made locally (no registry needed), for docker/cpu.Dockerfile:
#
#   sudo docker/make_base.sh [TAG]        # default localhost/debian:bookworm-local; ~4 min, 204 MB
#
# debootstrap a minimal bookworm and import it into podman. Runs as root (debootstrap). On a machine
# whose containers cannot raise rlimits (hybrid cgroups, a VM without CAP_SYS_RESOURCE), podman needs
# runc and explicit ulimits: docker/containers.conf (export CONTAINERS_CONF=docker/containers.conf).
set -euo pipefail
tag="${1:-localhost/debian:bookworm-local}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian
tar -C "$work/rootfs" -c . | podman import - "$tag"
