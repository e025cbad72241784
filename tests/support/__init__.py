"""Helpers the tests share (not tests themselves): converted-vs-dense parity runs, the suite's view of the
tolerance table, the per-sequence flow spy, IO binding, onnxruntime-genai's venv, torch references, tokenizer and
checkpoint fixtures. Imported as ``support.<module>`` (``tests/`` is on pytest's ``pythonpath``)."""
