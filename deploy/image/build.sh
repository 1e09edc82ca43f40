#!/bin/sh
# Build kvpool's image (kvpool:latest) where no image registry can be reached:
#   1. a Debian base from debootstrap (Debian's mirror is enough), imported as kvpool-base:SUITE (once);
#   2. kvpool's wheel and its dependencies' wheels made here, for the base's Python (3.11 in bookworm);
#   3. deploy/image/Dockerfile.wheels over them: nothing is fetched inside the build.
# Needs root (debootstrap), debootstrap, docker, and python3 with pip. Where a registry exists, `docker build .`
# with the Dockerfile at the top builds the same image from python:3.11-slim.
#   deploy/image/build.sh                 # kvpool:latest
#   IMAGE=kvpool:test SUITE=bookworm MIRROR=http://deb.debian.org/debian deploy/image/build.sh
set -eu
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
IMAGE=${IMAGE:-kvpool:latest}
BASE=kvpool-base:$SUITE
PYTHON=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kvpool-image.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    echo "building $BASE with debootstrap from $MIRROR"
    debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$WORK/rootfs" "$MIRROR" >"$WORK/debootstrap.log" \
        || { tail -20 "$WORK/debootstrap.log"; exit 1; }
    rm -rf "$WORK/rootfs/var/cache/apt/archives"/*.deb "$WORK/rootfs/var/lib/apt/lists"/*
    tar -C "$WORK/rootfs" -c . | docker import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$BASE"
fi

# The wheels for the base's Python, whatever Python runs this script.
VERSION=$(docker run --rm --entrypoint python3 "$BASE" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
mkdir -p "$WORK/context/wheels"
"$PYTHON" -m pip wheel -q --no-deps -w "$WORK/context/wheels" "$ROOT"
"$PYTHON" -m pip download -q --only-binary=:all: --python-version "$VERSION" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
    -d "$WORK/context/wheels" "$WORK/context/wheels"/kvpool-*.whl
cp "$ROOT/deploy/image/Dockerfile.wheels" "$WORK/context/Dockerfile"
docker build -q -t "$IMAGE" --build-arg BASE="$BASE" "$WORK/context"
echo "built $IMAGE over $BASE (Python $VERSION)"
