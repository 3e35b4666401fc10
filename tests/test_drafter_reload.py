"""Hot reload of the drafter's EAGLE-3 head under load, over real sockets.

While eight long greedy requests stream, the drafter is told to serve another head. Every request
must finish with exactly the target-only greedy tokens (independent reference: the in-process engine
without speculation), the running ones on the head they started with, new ones on the new head, and
the old head is freed once its last request is gone. A checkpoint that does not fit is refused and
serving goes on.
"""

from __future__ import annotations

import threading

import pytest

from services import generate, prompts_of, read_metrics, start_pair, wait_for
from tandem.errors import TandemError

pytestmark = pytest.mark.slow
NEW_TOKENS = 96


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    from draft_checkpoints import make_draft, write_pair

    root = tmp_path_factory.mktemp("reload")
    target = write_pair(root)
    make_draft(root / "draft_v2", target, seed=5)  # the "retrained" head
    make_draft(root / "other_layers", target, seed=5, aux_layer_ids=(1, 2, 3))  # reads layers the verifier does not send
    return root


@pytest.fixture(scope="module")
def reference(pair_dirs):
    from helpers import target_only_greedy

    return target_only_greedy(pair_dirs / "target", prompts_of(12), NEW_TOKENS)


def test_reload_under_load_loses_no_request(pair_dirs, reference, tmp_path):
    from tandem.reload_client import reload_drafter

    drafter, verifier = start_pair(pair_dirs, tmp_path)
    try:
        results, errors = {}, []

        def run(i):
            try:
                results[i] = generate(verifier.address, prompts_of(12)[i], max_new_tokens=NEW_TOKENS)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        drafts = lambda: read_metrics(verifier.metrics_port).get("tandem:spec_decode_num_drafts_total", 0)  # noqa: E731
        wait_for(lambda: drafts() >= 8, 60, "speculative rounds before the reload")
        reply = reload_drafter(drafter.address, str(pair_dirs / "draft_v2"))
        assert reply.generation == 2 and reply.draft_model.endswith("draft_v2")
        at_reload = drafts()
        for t in threads:
            t.join(180)
        assert not errors
        assert [results[i][0] for i in range(8)] == reference[:8]
        # Requests that were running at the reload kept speculating on their head to the end.
        assert reply.requests_on_previous >= 1
        assert drafts() > at_reload

        # A request after the reload drafts with the new head and is still exact.
        tokens, last = generate(verifier.address, prompts_of(12)[9], max_new_tokens=NEW_TOKENS)
        assert tokens == reference[9] and last.spec.rounds > 0
        wait_for(lambda: "freed draft head generation 1" in drafter.log(), 30, "the old head to be freed")

        # A head for other target layers cannot continue this verifier's stream: refused, nothing breaks.
        with pytest.raises(TandemError, match="FAILED_PRECONDITION.*layers"):
            reload_drafter(drafter.address, str(pair_dirs / "other_layers"))
        with pytest.raises(TandemError, match="PERMISSION_DENIED"):  # outside the reload root (the pair's folder)
            reload_drafter(drafter.address, str(tmp_path / "no_such_folder"))
        with pytest.raises(TandemError, match="FAILED_PRECONDITION"):  # below it, but a target, not a head
            reload_drafter(drafter.address, str(pair_dirs / "target"))
        tokens, last = generate(verifier.address, prompts_of(12)[10], max_new_tokens=NEW_TOKENS)
        assert tokens == reference[10] and last.spec.rounds > 0
        metrics = read_metrics(verifier.metrics_port)
        assert metrics["tandem:drafter_up"] == 1.0, "a refused reload must not cut the stream"
        assert metrics.get("tandem:drafter_failures_total", 0.0) == 0.0, "no reload may drop the stream, even briefly"

        # Idle: the last request's release reached the drafter when the verifier went idle (not with a next Round),
        # so a reload now finds no request on the previous head and frees it at once.
        reply = reload_drafter(drafter.address, str(pair_dirs / "draft_v2"))
        assert reply.generation == 3 and reply.requests_on_previous == 0
        wait_for(lambda: "freed draft head generation 2" in drafter.log(), 10, "the idle previous head to be freed")
    finally:
        verifier.stop()
        drafter.stop()
