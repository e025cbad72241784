#!/usr/bin/env bash
# The venvs of the export tools that cannot share ortpa's environment (ortpa/testing/export_tools.py), for
# scripts/make_fixtures_formats.py and `python -m ortpa.testing.sweep --tool genai|optimum`. Not for CI.
#
#   scripts/make_tool_venvs.sh [PREFIX]      # default PREFIX /tmp/ortpa-tool -> /tmp/ortpa-tool-genai, -optimum
#
# Each venv reaches torch, onnx and (genai) transformers 5 through a .pth file naming the site-packages of the
# Python that runs this script (ortpa's, with the `export` extra); the .pth comes after the venv's own
# site-packages, so the venv's own onnxruntime (genai) and transformers<4.58 (optimum) win. pip needs the network.
set -euo pipefail
prefix=${1:-/tmp/ortpa-tool}
python=${PYTHON:-python}
site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
make() {  # make NAME PACKAGES...
  local venv="$prefix-$1"; shift
  "$python" -m venv "$venv"
  echo "$site" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_ortpa.pth"
  "$venv/bin/pip" install -q "$@"
  echo "$venv: $("$venv/bin/python" -c 'import sys; print(sys.version.split()[0])')"
}
make genai "onnxruntime-genai==0.18.0" onnx-ir
make optimum "optimum-onnx==0.1.0" "transformers<4.58"
echo "export ORTPA_TOOL_PYTHON_GENAI=$prefix-genai/bin/python ORTPA_TOOL_PYTHON_OPTIMUM=$prefix-optimum/bin/python"
