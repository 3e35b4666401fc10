"""SpecConfig: the speculation setting of a request or an engine — SGLang's three knobs (tree depth, children per
node, tree size), validated with the flags named in every error. Light on purpose: the services' configs, the policy
and the drafter all read it."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.errors import ConfigError


@dataclass(frozen=True)
class SpecConfig:
    """SGLang's three speculative knobs; the flags are named in every error."""

    num_steps: int  # --speculative-num-steps: tree depth
    topk: int  # --speculative-eagle-topk: children per node and frontier width
    num_draft_tokens: int  # --speculative-num-draft-tokens: tree size including the root

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ConfigError(f"--speculative-num-steps must be >= 1, got {self.num_steps}")
        if self.topk < 1:
            raise ConfigError(f"--speculative-eagle-topk must be >= 1, got {self.topk}")
        if self.num_draft_tokens < 2:
            raise ConfigError(f"--speculative-num-draft-tokens must be >= 2 (the root plus one draft), got {self.num_draft_tokens}")
        if self.topk == 1 and self.num_draft_tokens > self.num_steps + 1:
            raise ConfigError(
                f"--speculative-eagle-topk 1 drafts a chain of --speculative-num-steps {self.num_steps} tokens, so "
                f"--speculative-num-draft-tokens must be <= {self.num_steps + 1}, got {self.num_draft_tokens}"
            )
        if self.num_draft_tokens - 1 > self.num_candidates:
            raise ConfigError(
                f"--speculative-num-draft-tokens {self.num_draft_tokens} exceeds the {self.num_candidates} candidates "
                f"+ root that --speculative-num-steps {self.num_steps} and --speculative-eagle-topk {self.topk} generate; "
                f"lower it to <= {self.num_candidates + 1} or raise the others"
            )

    @property
    def num_candidates(self) -> int:
        """Nodes generated before the final cut: topk at depth 1, topk² at each later depth."""
        return self.topk + (self.num_steps - 1) * self.topk**2
