"""Make Hugging Face models take, under fake tensors, the attention path they take in a real run.

transformers treats every FakeTensor as "tracing" when it builds attention masks: it cannot read fake position ids
to rule out packed sequences (`find_packed_sequence_indices`) nor decide that SDPA may rely on ``is_causal``
(`_ignore_causal_mask_sdpa`), so it materialises a causal mask and repeats KV heads instead of calling SDPA with
``is_causal=True`` and native GQA, which is what a real training step on ordinary batches does. The saved
activations would then be those of a run that never happens. While tracing, this shim answers those two questions
as a real run on unpacked, unpadded batches does, and leaves every other case (real tensors, padding masks, sliding
windows) to transformers. It touches nothing when transformers' masking module is not loaded, and restores the
originals on exit.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

from autopar.capture._torch_private import FakeTensor


@contextlib.contextmanager
def real_execution_paths() -> Iterator[None]:
    masking = sys.modules.get("transformers.masking_utils")
    if masking is None:
        yield
        return
    patches = {}
    if hasattr(masking, "_ignore_causal_mask_sdpa"):
        patches["_ignore_causal_mask_sdpa"] = _causal_skip(masking._ignore_causal_mask_sdpa)
    if hasattr(masking, "find_packed_sequence_indices"):
        patches["find_packed_sequence_indices"] = _unpacked_when_fake(masking.find_packed_sequence_indices)
    originals = {name: getattr(masking, name) for name in patches}
    for name, patched in patches.items():
        setattr(masking, name, patched)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(masking, name, original)


def _unpacked_when_fake(original: Callable[..., Any]) -> Callable[..., Any]:
    def find_packed_sequence_indices(position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids, *args, **kwargs)

    return find_packed_sequence_indices


def _causal_skip(original: Callable[..., bool]) -> Callable[..., bool]:
    signature = inspect.signature(original)

    def ignore_causal_mask(*args: Any, **kwargs: Any) -> bool:
        try:
            bound = signature.bind(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)
        q_length = bound.get("q_length", bound.get("query_length"))
        kv_length = bound.get("kv_length")
        window = bound.get("local_attention_size")
        if (
            bound.get("padding_mask") is None
            and isinstance(q_length, int)
            and isinstance(kv_length, int)
            and (window is None or kv_length < window)
            and (q_length == 1 or q_length == kv_length)
        ):
            return True
        return original(*args, **kwargs)

    return ignore_causal_mask
