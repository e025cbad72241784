"""examples/ray_serve.py on a local Ray cluster: 2 replicas, driven by the openai client."""

from __future__ import annotations

import asyncio
import sys

import pytest

from serve.helpers import EOS, MODEL_NAME, ROOT, free_port, get

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's own pydantic deprecations


@pytest.fixture(scope="module")
def ray_app(model_folder):
    import ray
    from ray import serve

    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import ray_serve
    finally:
        sys.path.remove(str(ROOT / "examples"))
    path = f"{ROOT}:{ROOT / 'examples'}"
    # address="local": a cluster another test started on this machine would be joined, and refuse num_cpus
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = ray_serve.build(str(model_folder), replicas=2, num_cpus=0.5, served_model_name=MODEL_NAME, num_blocks=64)
        serve.run(app, name="ortpa", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_like_ortpa_serve(ray_app, model_folder):
    from openai import AsyncOpenAI

    from ortpa.runtime.engine import Engine, SamplingParams

    assert get(ray_app + "/health")[0] == 200
    prompts = ["hello world", "the paged latent cache", "hello", "cache world the"] * 4

    async def all_at_once():
        client = AsyncOpenAI(base_url=ray_app + "/v1", api_key="unused", timeout=120, max_retries=0)
        try:
            calls = [
                client.completions.with_raw_response.create(model=MODEL_NAME, prompt=p, max_tokens=8, temperature=0)
                for p in prompts
            ]
            return await asyncio.gather(*calls)
        finally:
            await client.close()

    raw = asyncio.run(all_at_once())
    replicas = {r.headers["x-ortpa-replica"] for r in raw}
    texts = [r.parse().choices[0].text for r in raw]

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_folder / "tokenizer.json"))
    engine = Engine(str(model_folder / "model.onnx"), num_blocks=64)
    outputs = engine.generate([tokenizer.encode(p).ids for p in prompts], SamplingParams(8, stop_token_ids=(EOS,)))
    expected = [tokenizer.decode([t for t in out if t != EOS]) for out in outputs]  # as `ortpa generate` prints
    assert texts == expected
    assert len(replicas) == 2, replicas  # both replicas served some of the 16 concurrent requests
