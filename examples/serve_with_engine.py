"""Serve several prompts with ``Engine``: continuous batching, prefix caching, and one streamed request.

The engine schedules every request's prompt chunks and decodes into shared steps over one paged KV pool.
``generate`` returns whole outputs; ``stream`` yields ``(request_id, token)`` as each step produces them.

    python examples/serve_with_engine.py [DENSE_OR_PAGED_MODEL.onnx]
"""

import pathlib
import sys

import onnx

import ortpa
from ortpa.runtime.engine import Engine
from ortpa.runtime.sampling import SamplingParams

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "tests" / "fixtures" / "dsv3_sdpa_op18.onnx"


def main() -> int:
    model = onnx.load(sys.argv[1] if len(sys.argv) > 1 else DEFAULT)
    if not any(n.op_type == "PagedAttention" for n in model.graph.node):
        model = ortpa.convert(model)
    # Defaults: every step mixes decodes and prompt chunks, on CPU (portable op) as on the native kernels.
    engine = Engine(model, num_blocks=64, block_size=16)

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11] * 20, [1, 2, 3, 12]]
    greedy = SamplingParams(max_new_tokens=6)
    outputs = engine.generate(prompts, greedy)
    for prompt, out in zip(prompts, outputs, strict=True):
        print(f"generate: prompt of {len(prompt):2d} tokens -> {out}")

    # Stream one request (seeded sampling) while three others run in the same steps; the 20-token prompt's
    # full first block is reused from the prefix cache of the first run.
    streamed = engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=5, temperature=0.8, seed=0))
    others = [engine.add_request(p, greedy) for p in prompts[:3]]
    tokens = []
    for request_id, token in engine.stream([streamed]):
        tokens.append(token)
        print(f"stream: request {request_id} -> token {token}")
    rest = {i: [] for i in others}
    for request_id, token in engine.stream(others):
        rest[request_id].append(token)
    print(f"streamed request {streamed}: {tokens}; batched alongside {len(others)} others")
    if [rest[i] for i in others] != outputs[:3]:
        print("batched outputs differ from the first run")
        return 1

    s = engine.stats
    print(
        f"stats: {s.steps} steps, {s.generated_tokens} tokens generated, "
        f"{s.cached_tokens} prompt tokens from the prefix cache"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
