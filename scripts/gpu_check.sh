#!/usr/bin/env bash
# One command for a GPU machine: every `cuda` test (the native kernel vs the oracle and the portable op; the aliased
# PagedSession on the device; every converted fixture model natively on CUDA with IO-bound caches vs the portable
# CPU run, tests/gpu/test_cuda_fixtures.py), then the GPU-relevant benchmarks, then one summary.
# Needs: a CUDA device, `pip install ".[test,cuda]"` (onnxruntime-gpu is a core dependency). Under 10 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
echo "== ortpa GPU check: $(date -u +%FT%TZ)"
python - <<'PY'
import onnxruntime as ort
from ortpa.runtime.device import cuda_device_count
print("onnxruntime", ort.__version__, ort.get_available_providers(), "cuda devices:", cuda_device_count())
PY
timeout 240 python -m pytest -q -s -m cuda -p no:cacheprovider tests/gpu 2>&1 | tee "$log"
tests_rc=${PIPESTATUS[0]}
timeout 60 python -m ortpa.bench.portable --quick 2>&1 | tail -15 || true
# DeepSeek-V3 attention dims natively on CUDA: LATENT vs SEPARATE, achieved HBM bandwidth vs the device's peak.
# (`python benchmarks/decode_dsv3_cuda.py --dry-run` checks the same code on CPU at a tiny size.)
echo "== decode at DeepSeek-V3 dims (128 heads, 576/512 LATENT vs SEPARATE, block 64)"
timeout 300 python benchmarks/decode_dsv3_cuda.py 2>&1 | tail -70 || echo "decode_dsv3_cuda: failed or timed out"
# MLA prefill expanded vs absorbed vs dense natively on CUDA (the expanded path's parity is in the cuda tests:
# tests/gpu/test_cuda_fixtures.py converts with the default expanded prefill, and
# tests/rewriter/test_mla_prefill.py::test_expanded_native_cuda_matches_absorbed)
echo "== MLA prefill / decode at V2-Lite dims on CUDA (expanded vs absorbed vs dense)"
timeout 90 python -m pytest -q -s -m cuda -p no:cacheprovider tests/rewriter/test_mla_prefill.py 2>&1 | tail -3
ORTPA_BENCH_PROVIDER=cuda ORTPA_BENCH_MLA_LENGTHS=4096 timeout 150 python -m ortpa.bench.mla_prefill 2>&1 \
  | grep -E "ratio|speedup" || echo "mla_prefill bench: failed or timed out"
echo "== summary"
tail -1 "$log"
if grep -q "skipped" "$log" && ! grep -q "passed" "$log"; then
  echo "cuda tests were all skipped: no CUDA device visible to onnxruntime"
fi
exit "$tests_rc"
