"""SpecStats arithmetic, against counts worked out by hand."""

from tandem.speculative.stats import SpecStats


def test_accept_length_and_per_position_acceptance():
    s = SpecStats()
    s.record(tree_depth=3, accepted=0)
    s.record(tree_depth=3, accepted=2)
    s.record(tree_depth=2, accepted=1)
    assert s.rounds == 3
    assert s.accept_length_mean == 1 + 3 / 3
    # depth 1 drafted 3x accepted 2x; depth 2 drafted 3x accepted 1x; depth 3 drafted 2x accepted 0x
    assert s.acceptance_by_position == [2 / 3, 1 / 3, 0.0]


def test_no_acceptance_still_reports_every_drafted_position():
    s = SpecStats()
    s.record(tree_depth=4, accepted=0)
    assert s.acceptance_by_position == [0.0, 0.0, 0.0, 0.0]
    assert SpecStats().accept_length_mean == 1.0
