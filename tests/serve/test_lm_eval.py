"""lm-evaluation-harness' ``local-completions``, unmodified, against ``ortpa serve HF_DIR``: a log-likelihood task
and a ``generate_until`` task on a local jsonl (no hub downloads; the harness uses the server's tokenizer through
``/tokenizer_info`` and ``/tokenize``). The log-likelihoods equal those PyTorch computes with the checkpoint's
weights, within the float16 cache's bound (``ortpa.tolerances.logprob_bound``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from support.configs import TINY_LLAMA

from ortpa.tolerances import logprob_bound
from serve.helpers import EOS, MODEL_NAME, request, serve, write_tokenizer

pytestmark = pytest.mark.slow  # a checkpoint export (~25 s on 2 cores) and the harness (~15 s)

LLAMA = TINY_LLAMA
DOCS = [
    {"context": "hello world the", "continuation": " paged cache", "answer": "paged"},
    {"context": "the latent cache world hello the paged", "continuation": " latent world hello", "answer": "x"},
    {"context": "cache", "continuation": " the", "answer": "the"},
]


def _task_files(folder: Path) -> Path:
    folder.mkdir()
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (folder / "ll.yaml").write_text(
        "task: ortpa_loglikelihood\n" + common + "output_type: loglikelihood\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{continuation}}"\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "gen.yaml").write_text(
        "task: ortpa_generate\n" + common + "output_type: generate_until\n"
        'doc_to_text: "{{context}}"\ndoc_to_target: "{{answer}}"\n'
        "generation_kwargs:\n  until: ['</s>']\n  max_gen_toks: 5\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from ortpa.export.hf import build_model

    folder = tmp_path_factory.mktemp("lm-eval") / "ckpt"
    model = build_model(dict(LLAMA), seed=7)  # float32, random weights
    model.save_pretrained(folder)
    tokenizer = write_tokenizer(folder / "tokenizer.json")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    return folder, model, tokenizer


def test_lm_eval_local_completions_matches_pytorch(checkpoint, monkeypatch):
    import lm_eval
    import torch
    from lm_eval.tasks import TaskManager

    folder, model, tokenizer = checkpoint
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = _task_files(folder.parent / "tasks")
    with serve(folder, "--cache-dir", str(folder.parent / "cache"), startup_s=600) as server:
        out = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"model={MODEL_NAME},base_url={server.api}/completions,num_concurrent=1,max_retries=1",
            tasks=["ortpa_loglikelihood", "ortpa_generate"],
            task_manager=TaskManager(include_path=str(tasks)),
            log_samples=True,
        )
        generated = {}
        for doc in DOCS:
            body = {"model": MODEL_NAME, "prompt": doc["context"], "max_tokens": 5, "temperature": 0, "stop": ["</s>"]}
            _, _, raw = request("POST", server.api + "/completions", json.dumps(body).encode())
            generated[doc["context"]] = json.loads(raw)["choices"][0]["text"]
    scored = out["samples"]["ortpa_loglikelihood"]
    assert len(scored) == len(DOCS)
    worst = 0.0
    for sample in scored:
        doc = sample["doc"]
        ctx = tokenizer.encode(doc["context"], add_special_tokens=False).ids
        cont = tokenizer.encode(doc["continuation"], add_special_tokens=False).ids
        with torch.no_grad():
            logits = model(torch.tensor([ctx + cont])).logits[0].double().numpy()
        lp = logits - logits.max(axis=1, keepdims=True)
        lp -= np.log(np.exp(lp).sum(axis=1, keepdims=True))
        expected = sum(lp[len(ctx) - 1 + i, t] for i, t in enumerate(cont))
        greedy = all(int(np.argmax(lp[len(ctx) - 1 + i])) == t for i, t in enumerate(cont))
        (got, is_greedy), *_ = sample["resps"][0]
        bound = len(cont) * logprob_bound("float16")
        worst = max(worst, abs(got - expected))
        assert abs(got - expected) <= bound, (doc, got, expected, bound)
        assert is_greedy == greedy
    print(f"lm-eval log-likelihood: max |error| vs PyTorch float32 {worst:.2e}")
    for sample in out["samples"]["ortpa_generate"]:
        assert sample["resps"][0][0] == generated[sample["doc"]["context"]]
    assert any(generated.values())  # the model says something: an empty text would prove little
