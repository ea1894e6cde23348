#!/usr/bin/env bash
# Prepare tools/gpu_check.py for a GPU machine whose image has Python 3.12, torch, transformers,
# peft, accelerate, safetensors, tokenizers, numpy, PyYAML, sympy, tabulate -- but no Ray, no
# vLLM and no network: download (here) the wheels of what gpu_check's imports need beyond that
# image, at uv.lock's versions, into .whl/ (ignored by git), and print the command to run there.
#
#   tools/gpu_check.sh            # -> .whl/*.whl, their byte count, the device command
#
# Which packages: the distributions gpu_check.py --device cpu --quick imports (tempering's
# config layer: pydantic, omegaconf, hydra-core's override grammar; its environments:
# math-verify) minus the device image's package list (/work/.library/device/KINDS.md, 'Python
# packages already there'). antlr4-python3-runtime 4.9.3 (omegaconf's and hydra's parser) has
# no wheel on PyPI: it is built here from its sdist (pure Python, so the wheel fits any
# platform). typing-extensions rides along at the lock's version: pydantic-core needs a recent
# one and the image's version is not recorded.
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(pydantic pydantic-core annotated-types typing-inspection typing-extensions
          omegaconf hydra-core math-verify latex2sympy2-extended)
BUILT_FROM_SDIST=(antlr4-python3-runtime)
LIMIT=$((64 * 1024 * 1024))  # what the device tool carries in all
DEST=.whl

if ! git check-ignore -q "$DEST/x.whl"; then  # never committed
    echo "/$DEST/" >> "$(git rev-parse --git-path info/exclude)"
fi

lock_version() {  # NAME -> its version in uv.lock (exits if the lock does not hold it)
    python3 - "$1" <<'PY'
import sys, tomllib
name = sys.argv[1]
found = [p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"] if p["name"] == name]
if not found:
    sys.exit(f"gpu_check.sh: uv.lock has no package {name!r}; fix PACKAGES in tools/gpu_check.sh")
print(found[0])
PY
}

rm -rf "$DEST" && mkdir -p "$DEST"
for name in "${PACKAGES[@]}"; do
    spec="$name==$(lock_version "$name")"
    python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$DEST" "$spec"
    echo "gpu_check.sh: $spec"
done
for name in "${BUILT_FROM_SDIST[@]}"; do
    spec="$name==$(lock_version "$name")"
    python3 -m pip wheel --quiet --no-deps -w "$DEST" "$spec"
    echo "gpu_check.sh: $spec (built from its sdist)"
done

bytes=$(cat "$DEST"/*.whl | wc -c)
echo "gpu_check.sh: $(ls "$DEST"/*.whl | wc -l) wheels, $bytes bytes in $DEST/"
if (( bytes > LIMIT )); then
    echo "gpu_check.sh: $bytes bytes is over the $LIMIT the device carries; drop a package" >&2
    exit 1
fi
echo "gpu_check.sh: on the device (carry: [\"$DEST\"]), run:"
echo "python3 -m pip install --no-index --no-deps --target /tmp/site $DEST/*.whl && PYTHONPATH=/tmp/site:. python3 tools/gpu_check.py --device cuda --out \$OUT/gpu_check.json"
