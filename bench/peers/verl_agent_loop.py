"""verl's single-turn agent loop with a completion length per prompt, loaded by verl's agent-loop
workers (``actor_rollout_ref.rollout.agent.agent_loop_config_path``, written by
``bench.peers.verl_grpo.write_verl_files``); it imports verl, so only verl's processes load it.

Guarantee: each sample's vLLM request carries its row's ``min_tokens`` / ``max_tokens`` (from the
row's ``extra_info``, through ``apply_prompt_lengths``); everything else is verl's own loop.
"""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

from bench.peers.verl_grpo import apply_prompt_lengths


class PromptLengthAgentLoop(SingleTurnAgentLoop):
    """``SingleTurnAgentLoop`` whose request lengths are the prompt's own."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        params = apply_prompt_lengths(sampling_params, kwargs.get("extra_info"), self.response_length)
        return await super().run(params, **kwargs)
