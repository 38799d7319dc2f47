"""The pairs source: preference rows (prompt, chosen, rejected) as ``RolloutBatch``es for
DPO, offline (``algorithm.name: dpo``, ``data.pairs``): source -> reference -> trainer.

Guarantees:
- rows are read, cycled, admitted and accounted exactly as ``PromptSource`` reads
  prompts (the same ledger, checkpoints and resume); a row whose ``chosen`` or
  ``rejected`` field is missing or of the wrong type was already refused with its row
  number and field by pre-flight's data report (``stages/data/prompt_rows.py``), and is
  skipped with a counted reason here;
- each prompt becomes two consecutive samples, ``/0`` its chosen response and ``/1`` its
  rejected one (``group_size`` 2: a pair never straddles a split); ``rewards`` are the
  preference labels (1 chosen, 0 rejected), the loss reads the pair order;
- a plain response is its text's tokens followed by the end-of-sequence token (the
  model learns to stop); a chat response is what the chat template adds to the
  rendered prompt when the response's messages follow it, and a template that rewrites
  the prompt when a reply follows skips the row (``chat_template_error``);
- no policy generated these tokens: their version label is 0 and ``behaviour_logprobs``
  are 0; the trainer does not gate offline data on staleness.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
import numpy as np

from pipeline.plugins import register_stage
from pipeline.types import Prompt, RolloutBatch
from stages.data.files import RowError
from stages.data.source import PromptSource
from stages.rollout.base import Completion, GenerationResult
from stages.rollout.stage import build_rollout_batch

CHOSEN_REWARD, REJECTED_REWARD = 1.0, 0.0


def encode_response(tok: Any, prompt: str | list[Any], prompt_text: str, response: str | list[Any],
                    where: str, key: str) -> list[int]:
    """Token ids of one response after its rendered prompt (see the module rules)."""
    if isinstance(response, str):
        ids = list(tok(response, add_special_tokens=False)["input_ids"])
        return ids + ([tok.eos_token_id] if tok.eos_token_id is not None else [])
    assert isinstance(prompt, list)
    full = tok.apply_chat_template([*prompt, *response], tokenize=False)
    if not full.startswith(prompt_text) or len(full) == len(prompt_text):
        raise RowError("chat_template_error", f"{where}: the chat template does not render {key!r} as a "
                                              f"continuation of the prompt")
    return list(tok(full[len(prompt_text):], add_special_tokens=False)["input_ids"])


@register_stage("pairs")  # the source of an offline algorithm (dpo)
class PairSource(PromptSource):
    gives = RolloutBatch  # pipeline/contracts.py
    gives_fields = ("rewards",)

    def __init__(self, rows: list[dict[str, Any]] | None = None) -> None:
        super().__init__(rows)
        self._responses: dict[int, tuple[list[int], list[int]]] = {}  # prompt index -> (chosen, rejected) ids

    async def setup(self, ctx: Any) -> None:
        from stages.data.prompt_rows import load_tokenizer
        from stages.models.tiny import resolve_model_path

        await super().setup(ctx)
        self.tok = load_tokenizer(resolve_model_path(ctx.config.model))
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

    def _to_prompt(self, index: int, where: str, row: dict[str, Any], extra: dict[str, Any]) -> Prompt:
        pairs = self.data.pairs
        self._responses[index] = tuple(  # type: ignore[assignment]
            encode_response(self.tok, row["prompt"], row["text"], row[key], where, key)
            for key in (pairs.chosen_key, pairs.rejected_key))
        return super()._to_prompt(index, where, row, extra)

    async def generate(self) -> AsyncIterator[RolloutBatch]:  # type: ignore[override]
        async for pb in super().generate():
            results = []
            for p in pb.prompts:
                chosen, rejected = self._responses.pop(p.index)
                results.append(GenerationResult(prompt_token_ids=p.token_ids, completions=[
                    Completion(token_ids=ids, logprobs=[0.0] * len(ids), token_versions=[0] * len(ids),
                               finish_reason="stop", text=self.tok.decode(ids, skip_special_tokens=True))
                    for ids in (chosen, rejected)]))
            batch = build_rollout_batch(pb, results, 2, self.pad_id)
            rewards = np.tile(np.array([CHOSEN_REWARD, REJECTED_REWARD], dtype=np.float32), len(pb.prompts))
            yield msgspec.structs.replace(batch, rewards=rewards)
