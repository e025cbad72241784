"""Run a converted model with plain onnxruntime IO binding: no ortpa session, caches updated in place.

CPU has no PagedAttention kernel, so ``lower_to_portable`` replaces each node with standard ONNX ops. Each
layer's cache is one numpy array wrapped once in an ``OrtValue`` and bound both as ``past_key_values.{i}.key``
and as ``present.{i}.key``: the op writes the new rows into that buffer, whose address never changes.

    python examples/iobinding_by_hand.py [DENSE_OR_PAGED_MODEL.onnx]
"""

import pathlib
import sys

import numpy as np
import onnx
import onnxruntime as ort

import ortpa
from ortpa.ops.portable import lower_to_portable

ROOT = pathlib.Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "tests" / "fixtures" / "dsv3_sdpa_op18.onnx"
NUM_BLOCKS, BLOCK_SIZE = 8, 16


def main() -> int:
    model = onnx.load(sys.argv[1] if len(sys.argv) > 1 else DEFAULT)
    if not any(n.op_type == "PagedAttention" for n in model.graph.node):
        model = ortpa.convert(model)
    sess = ort.InferenceSession(lower_to_portable(model).SerializeToString(), providers=["CPUExecutionProvider"])
    np_types = {onnx.TensorProto.FLOAT16: np.float16, onnx.TensorProto.FLOAT: np.float32}

    caches: dict[str, tuple[np.ndarray, ort.OrtValue]] = {}  # input -> (numpy buffer, the OrtValue over it)
    for vi in model.graph.input:
        if vi.name.startswith("past_key_values."):
            heads, width = (d.dim_value for d in vi.type.tensor_type.shape.dim[2:])
            arr = np.zeros((NUM_BLOCKS, BLOCK_SIZE, heads, width), np_types[vi.type.tensor_type.elem_type])
            caches[vi.name] = (arr, ort.OrtValue.ortvalue_from_numpy(arr))
    ptrs = {name: ov.data_ptr() for name, (_, ov) in caches.items()}
    first = next(iter(caches))
    print(
        f"{len(caches)} caches of shape {caches[first][0].shape} {caches[first][0].dtype}; data_ptr {hex(ptrs[first])}"
    )

    # Two steps of one sequence in block 0: a 5-token prefill, then one decode token.
    steps = [([1, 2, 3, 4, 5], 0), ([7], 5)]
    for i, (ids, past) in enumerate(steps):
        io = sess.io_binding()
        io.bind_cpu_input("input_ids", np.array(ids, dtype=np.int64))
        io.bind_cpu_input("cumulative_sequence_lengths", np.array([0, len(ids)], dtype=np.int32))
        io.bind_cpu_input("past_sequence_lengths", np.array([past], dtype=np.int32))
        io.bind_cpu_input("block_table", np.array([[0]], dtype=np.int32))
        if any(vi.name == "attention_metadata" for vi in model.graph.input):
            total = past + len(ids)
            io.bind_cpu_input("attention_metadata", np.array([len(ids), total, total], dtype=np.int32))
        for name, (_, ov) in caches.items():
            io.bind_ortvalue_input(name, ov)
            io.bind_ortvalue_output(
                name.replace("past_key_values", "present"), ov
            )  # the same OrtValue: written in place
        io.bind_output("logits", "cpu")
        sess.run_with_iobinding(io)
        logits = io.get_outputs()[-1].numpy()  # outputs come back in binding order: logits is last
        arr = caches[first][0]
        rows = int(np.count_nonzero(np.abs(arr[0, :, 0, :]).sum(axis=-1)))
        print(f"step {i}: fed {len(ids)} token(s), next token {int(logits[0].argmax())}, cache rows filled {rows}")
        moved = [name for name, (_, ov) in caches.items() if ov.data_ptr() != ptrs[name]]
        if moved:
            print(f"data_ptr moved for {moved}")
            return 1

    filled = int(np.count_nonzero(np.abs(caches[first][0][0, :, 0, :]).sum(axis=-1)))
    print(f"data_ptr unchanged over {len(steps)} steps; numpy cache changed in place ({filled} rows written)")
    return 0 if filled == sum(len(ids) for ids, _ in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
