"""Attention backends beside model/attention.py's own paths (SDPA over gathered blocks, the C kernel):
flex_paged.py reads the paged KV cache in place with torch's FlexAttention."""
