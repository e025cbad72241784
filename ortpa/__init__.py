"""ortpa: dense-attention ONNX LLMs to paged-KV models on ONNX Runtime's PagedAttention."""

from ortpa.errors import (
    ConversionError,
    InvalidArgument,
    InvalidModel,
    NotImplementedByBackend,
    OrtpaError,
    OutOfBlocks,
)

__version__ = "0.1.0"

__all__ = [
    "ConversionError",
    "InvalidArgument",
    "InvalidModel",
    "NotImplementedByBackend",
    "OrtpaError",
    "OutOfBlocks",
    "__version__",
]
