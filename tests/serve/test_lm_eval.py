"""lm-evaluation-harness' ``local-completions``, unmodified, against a live ``ortpa serve``: a log-likelihood task
and a ``generate_until`` task on a local jsonl (no hub downloads; the harness uses the server's tokenizer through
``/tokenizer_info`` and ``/tokenize``).

The served model is the Llama fixture converted (the session's shared server); transformers rebuilds the same
weights from the fixture's config and seed (checked against the ONNX file's embedding), so the harness's answers
are checked against PyTorch: the log-likelihoods within the float16 cache's bound
(``ortpa.tolerances.logprob_bound``), the generated text equal to PyTorch's greedy continuation (up to a tie of
the float16 precision, ``ortpa.tolerances.precision_ties``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from ortpa.tolerances import logprob_bound, precision_ties
from serve.helpers import EOS, MODEL_NAME, SOURCE

DOCS = [
    {"context": "hello world the", "continuation": " paged cache", "answer": "paged"},
    {"context": "the latent cache world hello the paged", "continuation": " latent world hello", "answer": "x"},
    {"context": "cache", "continuation": " the", "answer": "the"},
]
MAX_GEN = 5


def _task_files(folder: Path) -> Path:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    # the datasets cache inside the test's folder: parallel test workers never share one
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n  cache_dir: {folder / 'hf'}\n"
        "test_split: test\n"
    )
    (folder / "ll.yaml").write_text(
        "task: ortpa_loglikelihood\n" + common + "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "gen.yaml").write_text(
        "task: ortpa_generate\n" + common + "output_type: generate_until\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
        f"generation_kwargs:\n  until: ['</s>']\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def _pytorch_model():
    """The fixture's transformers model: its recorded config, seed 0 (``scripts/make_fixtures_mha.py``)."""
    from ortpa.export.hf import build_model

    config = json.loads(SOURCE.with_suffix(".json").read_text())["config"]
    model = build_model(config, seed=0)
    stored = {t.name: t for t in onnx.load(str(SOURCE)).graph.initializer}["inner.model.embed_tokens.weight"]
    torch_embedding = model.model.embed_tokens.weight.detach().numpy()
    if not np.array_equal(numpy_helper.to_array(stored), torch_embedding):
        raise AssertionError(f"build_model({config}, seed=0) does not rebuild the weights of {SOURCE}")
    return model


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    lp = logits - logits.max(axis=-1, keepdims=True)
    return lp - np.log(np.exp(lp).sum(axis=-1, keepdims=True))


def test_lm_eval_local_completions_matches_pytorch(server, tokenizer, tmp_path, monkeypatch):
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL_NAME},base_url={server.api}/completions,num_concurrent=2,max_retries=1",
        tasks=["ortpa_loglikelihood", "ortpa_generate"],
        # only our two tasks: indexing the harness' thousands of bundled task files takes ~20 s
        task_manager=TaskManager(include_path=str(_task_files(tmp_path)), include_defaults=False),
        log_samples=True,
    )
    model = _pytorch_model()

    scored = out["samples"]["ortpa_loglikelihood"]
    assert sorted(s["doc"]["context"] for s in scored) == sorted(d["context"] for d in DOCS)
    worst = 0.0
    for sample in scored:
        doc = sample["doc"]
        ctx = tokenizer.encode(doc["context"], add_special_tokens=False).ids
        cont = tokenizer.encode(doc["continuation"], add_special_tokens=False).ids
        with torch.no_grad():
            lp = _log_softmax(model(torch.tensor([ctx + cont])).logits[0].double().numpy())
        expected = sum(lp[len(ctx) - 1 + i, t] for i, t in enumerate(cont))
        greedy = all(int(np.argmax(lp[len(ctx) - 1 + i])) == t for i, t in enumerate(cont))
        (got, is_greedy), *_ = sample["resps"][0]
        bound = len(cont) * logprob_bound("float16")
        worst = max(worst, abs(got - expected))
        assert abs(got - expected) <= bound, (doc, got, expected, bound)
        assert is_greedy == greedy, doc
    print(f"lm-eval log-likelihood: max |error| vs PyTorch float32 {worst:.2e}")

    ties = precision_ties("float16")
    generated = out["samples"]["ortpa_generate"]
    assert len(generated) == len(DOCS)
    checked = 0
    for sample in generated:
        got = tokenizer.encode(sample["resps"][0][0], add_special_tokens=False).ids
        want, tied = _pytorch_greedy(model, tokenizer.encode(sample["doc"]["context"]).ids, ties)
        # up to a tie of the float16 precision the text is PyTorch's; past one either token is right
        assert (got[: len(want)] if tied else got) == want, (sample["doc"], got, want, tied)
        checked += len(want)
    assert checked >= MAX_GEN, checked  # enough tokens compared: an empty text would prove little
    print(f"lm-eval generate_until: {checked} tokens equal to PyTorch's greedy ones")


def _pytorch_greedy(model, ids: list[int], ties) -> tuple[list[int], bool]:
    """PyTorch's greedy tokens (at most ``MAX_GEN``, up to EOS) and whether they stop short at a near-tie."""
    import torch

    out: list[int] = []
    with torch.no_grad():
        while len(out) < MAX_GEN:
            row = model(torch.tensor([ids + out])).logits[0, -1].numpy()
            token = int(row.argmax())
            if row[token] - float(np.sort(row)[-2]) <= ties.margin(row):
                return out, True
            if token == EOS:
                break
            out.append(token)
    return out, False
