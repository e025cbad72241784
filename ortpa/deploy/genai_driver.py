"""Drive onnxruntime-genai's continuous-batching Engine on a folder, as written: run in genai's own Python.

onnxruntime-genai brings its own ``onnxruntime`` wheel, which cannot share an environment with ortpa's
onnxruntime-gpu, so this file imports nothing from ortpa and is run as a script by the Python of a venv that has
``onnxruntime-genai`` (tests, ``ortpa bench``)::

    GENAI_PYTHON ortpa/deploy/genai_driver.py < request.json > result.json

The request: ``{"folder": ..., "scenarios": [{"name": ..., "prompts": [[ids...], ...], "max_new_tokens": n,
"stagger": k}]}``; ``stagger`` 0 admits every request before the first step, k > 0 admits request i after
``i * k`` engine steps. ``"dense_folder"`` (optional) also runs genai's classic ``Generator`` there on each
prompt alone (``"dense": true`` in a scenario). The result: ``{"scenarios": {name: {"tokens": [[...], ...],
"seconds": s, "generated": n}}, "versions": {...}}``; an engine error is ``{"error": message}`` and exit 1.
"""

from __future__ import annotations

import json
import sys
import time

__all__ = ["main"]


def _engine_run(og, np, model, prompts, max_new, stagger):
    """Greedy tokens of every prompt through one Engine; request i is admitted after ``i * stagger`` steps."""
    engine = og.Engine(model)
    tokens = [[] for _ in prompts]
    live = []  # (request, prompt index)
    pending = list(range(len(prompts)))
    token_flag = og.EngineEventFlags.TOKEN.value
    done_flag = og.EngineEventFlags.TURN_FINISHED.value
    failed_flag = og.EngineEventFlags.FAILED.value
    buf = engine.create_event_buffer(256)
    step = 0
    start = time.perf_counter()
    while pending or live:
        while pending and step >= pending[0] * stagger:
            i = pending.pop(0)
            req = engine.create_request()
            to = og.TurnOptions(req)
            to.set_max_generated_tokens(max_new)
            to.set_do_sample(False)
            req.begin_turn(np.array(prompts[i], dtype=np.int32), to)
            live.append((req, i))
        step += 1
        if not engine.has_pending_requests():
            continue
        finished = []
        for ev in engine.run(buf):
            i = next(k for r, k in live if r is ev.request)
            flags = ev.flags.value
            if flags & failed_flag or ev.error_code != og.EngineErrorCode.NONE:
                raise RuntimeError(f"request {i} failed: {ev.error_code} ({ev.finish_reason})")
            if flags & token_flag:
                tokens[i].append(int(ev.token))
            if flags & done_flag:
                finished.append(i)
        for r, k in [entry for entry in live if entry[1] in finished]:
            r.close()  # a finished request keeps its batch slot until closed
            live.remove((r, k))
        if step > 100000:
            raise RuntimeError("the engine did not finish within 100000 steps")
    return tokens, time.perf_counter() - start


def _dense_run(og, np, folder, prompts, max_new):
    model = og.Model(folder)
    tokens = []
    start = time.perf_counter()
    for prompt in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + max_new, min_length=0)
        gen = og.Generator(model, params)
        gen.append_tokens(np.array(prompt, dtype=np.int32))
        out = []
        while not gen.is_done() and len(out) < max_new:
            gen.generate_next_token()
            out.append(int(gen.get_next_tokens()[0]))
        tokens.append(out)
    return tokens, time.perf_counter() - start


def main() -> int:
    import numpy as np
    import onnxruntime_genai as og

    request = json.load(sys.stdin)
    result = {"scenarios": {}, "versions": {"onnxruntime-genai": getattr(og, "__version__", "?")}}
    try:
        model = og.Model(og.Config(request["folder"]))
        for sc in request["scenarios"]:
            if sc.get("dense"):
                toks, secs = _dense_run(og, np, request["dense_folder"], sc["prompts"], sc["max_new_tokens"])
            else:
                toks, secs = _engine_run(og, np, model, sc["prompts"], sc["max_new_tokens"], sc.get("stagger", 0))
            result["scenarios"][sc["name"]] = {"tokens": toks, "seconds": secs, "generated": sum(map(len, toks))}
    except Exception as exc:  # genai's errors are RuntimeError with its message: hand it back as one line
        json.dump({"error": " ".join(str(exc).split())[:2000], **result}, sys.stdout)
        return 1
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
