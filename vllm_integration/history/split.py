"""What every history branch's metadata shares (vLLM's Mamba metadata): decodes first, then prefills."""


def token_split(metadata) -> tuple[slice, slice]:
    """(decode tokens, prefill tokens) of a packed batch: vLLM orders decodes (one new token) first. Rows past both
    are CUDA-graph padding, left unwritten (every later op works row by row)."""
    num_decode_tokens = metadata.num_decode_tokens
    return slice(0, num_decode_tokens), slice(num_decode_tokens, num_decode_tokens + metadata.num_prefill_tokens)
