"""The NumPy reference of ``com.microsoft::PagedAttention``: every execution path of ortpa is checked against it.

``attention`` is the op (:func:`paged_attention`, every mode); ``sanitize`` the kernel's treatment of malformed
index inputs, ``rope`` the Q/K prologue (RMSNorm, rotary), ``quant`` the cache element formats.
"""

from ortpa.ops.oracle.attention import paged_attention

__all__ = ["paged_attention"]
