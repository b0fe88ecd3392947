#!/usr/bin/env bash
# The wheels the GPU machine lacks, into .gpu/ (git-ignored), for the device call to carry (carry=[".gpu"];
# docs/gpu.md). That machine installs nothing and has transformers 5.17, below the integration's floor
# (poslsh.integrations.MIN_TRANSFORMERS); gpu_stages.sh unpacks these wheels there and puts them first on
# PYTHONPATH. Only what its installed packages cannot serve travels: transformers at the newest release
# the integration tests run on, the huggingface-hub it needs (>= 2.4; the machine has 1.33) and what
# that hub release needs beyond the machine's packages. All pure Python (py3-none-any), about 15 MiB.
#
#   bash benchmarks/gpu_bundle.sh        # or: make gpu-bundle   (needs the package index, here, once)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
  transformers==5.25.0      # the newest release of the tested range (make test runs the integration on it)
  huggingface-hub==2.4.0    # transformers 5.25 checks huggingface-hub >= 2.4.0 at import
  httpx2==2.17.0            # huggingface-hub 2.4's HTTP client (new package names: not on the machine)
  httpcore2==2.17.0
  truststore==0.10.5
)
rm -rf .gpu && mkdir -p .gpu
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .gpu "${WHEELS[@]}"
for whl in .gpu/*; do
  case $whl in *-py3-none-any.whl) ;; *) echo "gpu_bundle: $whl is not pure Python; it may not run there" >&2 ;; esac
done
size=$(du -sm .gpu | cut -f1)
echo "gpu_bundle: $(ls .gpu | tr '\n' ' ')in .gpu/ (${size} MiB; the device call carries at most 64 MiB with the tree)"
[ "$size" -lt 48 ] || { echo "gpu_bundle: .gpu/ is ${size} MiB, too much to carry beside the tree" >&2; exit 1; }
