"""Queue entries without Ray: which items ride inline, and the end-of-stream marker."""

from __future__ import annotations

import asyncio
import pickle

import numpy as np

from pipeline.queue import END, INLINE_MAX_BYTES, fits_inline, is_end, resolve_entry
from pipeline.types import Prompt, PromptBatch


def test_small_items_fit_inline_and_large_arrays_do_not():
    assert fits_inline(np.zeros(1024, np.uint8))
    # Exactly the limit fits; one byte more does not.
    assert fits_inline(np.zeros(INLINE_MAX_BYTES, np.uint8))
    assert not fits_inline(np.zeros(INLINE_MAX_BYTES + 1, np.uint8))
    # Through Structs and lists: 4 prompts of 8 characters and 3 token ids each are a
    # few hundred bytes; 100 prompts of 1 KiB of text are 100 KiB.
    small = PromptBatch(batch_id=0, step=0, prompts=[Prompt(prompt_id=f"p{i}", text="x" * 8, token_ids=[1, 2, 3])
                                                      for i in range(4)])
    big = PromptBatch(batch_id=0, step=0, prompts=[Prompt(prompt_id=f"p{i}", text="x" * 1024) for i in range(100)])
    assert fits_inline(small) and not fits_inline(big)


def test_end_is_told_apart_from_values_without_comparing_them():
    # An inline numpy value must not be compared elementwise with END.
    assert not is_end(np.zeros(3)) and not is_end([END])
    assert is_end(END) and is_end(pickle.loads(pickle.dumps(END)))  # as it arrives from another process


def test_an_inline_entry_resolves_to_itself():
    value = np.arange(3)
    assert asyncio.run(resolve_entry(value)) is value
