"""Post-SFT objectives (anchor-priors paper §5.6, App. D): DPO, then GSPO / GRPO with a verifiable math reward.

``losses``: log-probs and entropy of responses, group advantages, the clipped policy loss, the DPO loss.
``rewards``: the math answer reward (math-verify, else GSM8K extraction) and DAPO's soft overlong punishment.
"""

from __future__ import annotations

from thinpipe.objective.losses import dpo_loss, group_advantages, policy_loss, response_logprobs, token_entropy
from thinpipe.objective.rewards import extract_answer, math_reward, math_verify_available, overlong_penalty

__all__ = ["dpo_loss", "extract_answer", "group_advantages", "math_reward", "math_verify_available",
           "overlong_penalty", "policy_loss", "response_logprobs", "token_entropy"]
