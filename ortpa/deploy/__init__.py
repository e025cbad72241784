"""Deploy a converted model anywhere ONNX Runtime runs: a portable paged file and a genai_config.json.

* :mod:`ortpa.deploy.portable_file` — lower a paged graph's PagedAttention nodes to standard ONNX ops.
* :mod:`ortpa.deploy.genai_config` — the ``genai_config.json`` onnxruntime-genai's Engine serves the folder with.
* :mod:`ortpa.deploy.deployment` — both, for a paged file that exists already (``ortpa convert`` makes them
  before it publishes its output: :mod:`ortpa.conversion`).
"""

from ortpa.deploy.deployment import Deployment, finish_deployment
from ortpa.deploy.genai_config import GenaiOptions, build_genai_config, write_genai_config
from ortpa.deploy.portable_file import (
    MIN_ONNXRUNTIME_KEY,
    PortableInfo,
    lower_file,
    lower_graph,
    min_onnxruntime,
    portable_info,
)

__all__ = [
    "MIN_ONNXRUNTIME_KEY",
    "Deployment",
    "GenaiOptions",
    "PortableInfo",
    "build_genai_config",
    "finish_deployment",
    "lower_file",
    "lower_graph",
    "min_onnxruntime",
    "portable_info",
    "write_genai_config",
]
