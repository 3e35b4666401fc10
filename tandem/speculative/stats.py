"""Per-request speculation statistics: rounds, accepted tokens per round, per-position acceptance."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0  # verify rounds that carried at least one drafted token
    accepted_per_round: list[int] = field(default_factory=list)  # drafted tokens accepted (bonus excluded)
    drafted_at_depth: list[int] = field(default_factory=list)  # [d]: rounds whose tree reached depth d+1
    accepted_at_depth: list[int] = field(default_factory=list)  # [d]: rounds that accepted a token at depth d+1

    def record(self, tree_depth: int, accepted: int) -> None:
        self.rounds += 1
        self.accepted_per_round.append(accepted)
        for counts, upto in ((self.drafted_at_depth, tree_depth), (self.accepted_at_depth, accepted)):
            if len(counts) < upto:
                counts.extend([0] * (upto - len(counts)))
            for d in range(upto):
                counts[d] += 1

    @property
    def accept_length_mean(self) -> float:
        """Tokens emitted per verify round (accepted drafts + the bonus token); 1.0 without speculation."""
        if not self.rounds:
            return 1.0
        return 1.0 + sum(self.accepted_per_round) / self.rounds

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of rounds accepting the draft token at depth d (given the tree reached depth d)."""
        accepted = self.accepted_at_depth + [0] * (len(self.drafted_at_depth) - len(self.accepted_at_depth))
        return [a / d if d else 0.0 for a, d in zip(accepted, self.drafted_at_depth)]

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "accepted_per_round": list(self.accepted_per_round),
            "accept_length_mean": self.accept_length_mean,
            "acceptance_by_position": self.acceptance_by_position,
        }
