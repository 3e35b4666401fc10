"""The verifier and drafter services over real sockets: streaming, continuous batching, bad input,
cancellation, a drafter that dies and comes back, and shared-memory cleanup.

References are independent of the services: target-only greedy decoding by the in-process engine
(itself checked token-for-token against transformers in test_hf_parity / test_spec_engine).
"""

from __future__ import annotations

import os
import signal
import threading

import grpc
import pytest

from services import Service, generate, prompts_of, read_metrics, shm_segments, start_pair, wait_for
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(pair_dirs):
    """Target-only greedy continuations of prompts_of(32), 24 new tokens each."""
    from helpers import target_only_greedy

    return target_only_greedy(pair_dirs / "target", prompts_of(32), 24)


@pytest.fixture(scope="module")
def pair(pair_dirs, tmp_path_factory):
    drafter, verifier = start_pair(pair_dirs, tmp_path_factory.mktemp("logs"))
    yield drafter, verifier
    verifier.stop()
    drafter.stop()


def test_stream_equals_target_only_greedy(pair, reference):
    _, verifier = pair
    assert "rounds on the round lane" in verifier.log()  # the default transport, where it can be set up
    assert read_metrics(verifier.metrics_port)["tandem:drafter_round_lane"] == 1.0
    for i in (0, 5, 9):
        tokens, last = generate(verifier.address, prompts_of(32)[i])
        assert tokens == reference[i]
        assert last.finish_reason == "length" and last.completion_tokens == 24
        assert last.spec.rounds > 0  # the drafter drafted for it
    # The drafter reports its work per round split into its extends and its drafts: both happen every round.
    m = read_metrics(verifier.metrics_port)
    extend, draft = (m[f'tandem:drafter_work_seconds_sum{{phase="{p}"}}'] for p in ("extend", "draft"))
    assert extend > 0 and draft > 0
    # Steady decoding of one request: its next Round goes out at the end of each step (prefetched) and the
    # next step uses it; only a request's first draft (after its prefill) and changes go out directly.
    assert m['tandem:drafter_rounds_total{kind="prefetched"}'] > m.get('tandem:drafter_rounds_total{kind="direct"}', 0)
    # The drafter's own metrics: every Round the verifier sent was served there, each drafting at least one
    # tree but those sent idle (the last request's release); its head took in each prompt (its tokens after the
    # first, and the first output) and at most every token after it.
    snapshots = []  # (sent and served: the idle round that takes the last release may be under way between the reads)

    def settled() -> bool:
        m = read_metrics(verifier.metrics_port)
        d = read_metrics(pair[0].metrics_port)
        snapshots.append((m, d, sum(v for k, v in m.items() if k.startswith("tandem:drafter_rounds_total{"))))
        return d['tandem:drafter_served_rounds_total{kind="drafts"}'] == snapshots[-1][2]

    wait_for(settled, 10, "every Round the verifier sent to be served there")
    m, d, sent = snapshots[-1]
    assert d["tandem:drafter_trees_total"] >= sent - m.get('tandem:drafter_rounds_total{kind="flush"}', 0)
    lengths = [len(prompts_of(32)[i]) for i in (0, 5, 9)]
    assert sum(lengths) < d["tandem:drafter_extend_tokens_total"] <= sum(n + 24 for n in lengths)
    assert d["tandem:drafter_verifier_connected"] == 1.0


def test_concurrent_requests_batch_together_and_none_is_lost(pair, reference):
    _, verifier = pair
    prompts = prompts_of(32)
    results: dict[int, list[int]] = {}
    errors = []

    def run(i):
        try:
            results[i] = generate(verifier.address, prompts[i])[0]
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors
    assert [results[i] for i in range(32)] == reference
    m = read_metrics(verifier.metrics_port)
    single = m['tandem:iteration_batch_size_bucket{le="1.0"}']
    assert m["tandem:iteration_batch_size_count"] > single, "no engine step ever held two requests"
    assert m['tandem:iteration_batch_size_bucket{le="8.0"}'] < m["tandem:iteration_batch_size_count"], \
        "the batch never grew past 8 requests"


@pytest.mark.parametrize("request_kwargs, field", [
    (dict(prompt_token_ids=[], sampling=pb.SamplingParams(max_new_tokens=4)), "prompt_token_ids"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=0)), "max_new_tokens"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=10**6)), "max_new_tokens"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, temperature=-1)), "temperature"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, top_p=1.5)), "top_p"),
    (dict(prompt_token_ids=[1] * 600, sampling=pb.SamplingParams(max_new_tokens=4)), "context"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, min_p=1.5)), "min_p"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, logprobs=21)), "logprobs"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, min_tokens=5)), "min_tokens"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, presence_penalty=3)),
     "presence_penalty"),
    (dict(prompt_token_ids=[10**6], sampling=pb.SamplingParams(max_new_tokens=4)), "vocabulary"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, stop_token_ids=[3, -5])),
     "stop_token_ids: -5 is outside the vocabulary"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, stop_token_ids=[3] * 257)),
     "stop_token_ids: at most 256"),
    (dict(prompt_token_ids=[1, 2], sampling=pb.SamplingParams(max_new_tokens=4, prompt_logprobs=1,
                                                                prompt_logprobs_from=3)), "prompt_logprobs_from"),
])
def test_bad_input_is_invalid_argument_naming_the_field(pair, reference, request_kwargs, field):
    _, verifier = pair
    with grpc.insecure_channel(verifier.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.VerifierStub(channel).Generate(pb.GenerateRequest(**request_kwargs), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    assert generate(verifier.address, prompts_of(32)[1])[0] == reference[1]  # still serving


def test_logprobs_over_the_stream_equal_transformers_while_speculating(pair, pair_dirs, reference):
    """Each message carries one TokenLogprobs per token: the target's raw log-softmax (transformers on the
    same weights) at the position that produced it, from the verify of a drafted round; the first message
    carries the prompt's (every token after the first)."""
    import torch
    from transformers import AutoModelForCausalLM

    _, verifier = pair
    prompt = prompts_of(32)[3]
    with grpc.insecure_channel(verifier.address) as channel:
        request = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
            max_new_tokens=24, ignore_eos=True, logprobs=3, prompt_logprobs=2))
        messages = list(pb_grpc.VerifierStub(channel).Generate(request, timeout=120))
    tokens = [t for m in messages for t in m.token_ids]
    entries = [e for m in messages for e in m.logprobs]
    assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
    assert len(messages[0].prompt_logprobs) == len(prompt) - 1 and not any(m.prompt_logprobs for m in messages[1:])
    assert tokens == reference[3] and messages[-1].spec.rounds > 0
    hf = AutoModelForCausalLM.from_pretrained(pair_dirs / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + tokens])).logits[0].log_softmax(-1)
    for t, entry in enumerate(messages[0].prompt_logprobs, start=1):
        assert abs(entry.logprob - ref[t - 1, prompt[t]].item()) <= 1e-3
        assert list(entry.top_token_ids) == ref[t - 1].topk(2).indices.tolist()
    for j, (token, entry) in enumerate(zip(tokens, entries)):
        row = ref[len(prompt) - 1 + j]
        assert abs(entry.logprob - row[token].item()) <= 1e-3
        assert list(entry.top_token_ids) == row.topk(3).indices.tolist()
        assert max(abs(a - b) for a, b in zip(entry.top_logprobs, row.topk(3).values.tolist())) <= 1e-3


def test_prompt_logprobs_from_a_position_reuse_the_cached_context_and_equal_transformers(pair, pair_dirs):
    """SGLang's logprob_start_len over the service: a context served once, then scored with a continuation from the
    continuation's first token. Its pages before that position come from the prefix cache, and the entries are the
    target's raw log-softmax (transformers on the same weights) for each token from there on."""
    import torch
    from transformers import AutoModelForCausalLM

    _, verifier = pair
    context = [t for p in prompts_of(32)[5:15] for t in p]  # (several pages)
    prompt = context + prompts_of(32)[7][:9]
    start = len(context)
    with grpc.insecure_channel(verifier.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        list(stub.Generate(pb.GenerateRequest(prompt_token_ids=context, sampling=pb.SamplingParams(max_new_tokens=2)),
                           timeout=120))
        messages = list(stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
            max_new_tokens=2, prompt_logprobs=2, prompt_logprobs_from=start)), timeout=120))
    assert messages[0].cached_tokens > 0 and len(messages[0].prompt_logprobs) == len(prompt) - start
    hf = AutoModelForCausalLM.from_pretrained(pair_dirs / "target", dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for t, entry in enumerate(messages[0].prompt_logprobs, start=start):
        assert abs(entry.logprob - ref[t - 1, prompt[t]].item()) <= 1e-3
        assert list(entry.top_token_ids) == ref[t - 1].topk(2).indices.tolist()


def test_malformed_protobuf_is_invalid_argument(pair):
    _, verifier = pair
    with grpc.insecure_channel(verifier.address) as channel:
        raw = channel.unary_stream("/tandem.rpc.verifier.v1.Verifier/Generate",
                                   request_serializer=lambda b: b, response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as err:
            list(raw(b"\x0a\xff\xff\xff\xff", timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_cancel_frees_the_requests_kv(pair):
    _, verifier = pair
    with grpc.insecure_channel(verifier.address) as channel:
        call = pb_grpc.VerifierStub(channel).Generate(pb.GenerateRequest(
            prompt_token_ids=prompts_of(32)[3], sampling=pb.SamplingParams(max_new_tokens=400, ignore_eos=True)))
        next(call)
        next(call)
        m = read_metrics(verifier.metrics_port)
        assert m["tandem:kv_pages_free"] < m["tandem:kv_pages_capacity"]
        call.cancel()
    wait_for(lambda: (lambda m: m["tandem:kv_pages_free"] == m["tandem:kv_pages_capacity"])(
             read_metrics(verifier.metrics_port)),
             30, "the cancelled request's KV pages to come back")


def test_rounds_on_the_grpc_stream_equal_target_only_greedy(pair_dirs, reference, tmp_path):
    """The stream transport (the fallback when no round lane can be set up) serves the same rounds."""
    drafter, verifier = start_pair(pair_dirs, tmp_path, verifier_args=("--disable-round-lane",))
    try:
        assert "rounds on the gRPC stream" in verifier.log()
        assert read_metrics(verifier.metrics_port)["tandem:drafter_round_lane"] == 0.0
        for i in (1, 6):
            tokens, last = generate(verifier.address, prompts_of(32)[i])
            assert tokens == reference[i] and last.spec.rounds > 0
        assert read_metrics(verifier.metrics_port)['tandem:drafter_rounds_total{kind="prefetched"}'] > 0
    finally:
        verifier.stop()
        drafter.stop()


def test_without_prefetching_every_round_is_sent_when_it_drafts(pair_dirs, reference, tmp_path):
    drafter, verifier = start_pair(pair_dirs, tmp_path, verifier_args=("--disable-round-prefetch",))
    try:
        for i in (2, 7):
            tokens, last = generate(verifier.address, prompts_of(32)[i])
            assert tokens == reference[i] and last.spec.rounds > 0
        m = read_metrics(verifier.metrics_port)
        assert m['tandem:drafter_rounds_total{kind="direct"}'] > 0
        assert m.get('tandem:drafter_rounds_total{kind="prefetched"}', 0.0) == 0.0
    finally:
        verifier.stop()
        drafter.stop()


def test_a_drafter_whose_kv_cache_cannot_hold_the_batch_serves_on_without_failing_a_round(pair_dirs, reference,
                                                                                      tmp_path):
    """A head sized below the running batch (--max-kv-tokens 160: 10 pages of 16 for 8 requests of 56 tokens) sheds
    its newest requests (tandem/speculative/head_room.py) instead of failing the round with OutOfPagesError, which
    closed the round lane, dropped every request's speculation and met the same failure after each reconnect."""
    drafter, verifier = start_pair(pair_dirs, tmp_path, drafter_args=("--max-kv-tokens", "160"))
    try:
        results: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate(verifier.address,
                                                                                        prompts_of(32)[i])))
                   for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert [results[i][0] for i in range(8)] == reference[:8]
        assert sum(results[i][1].spec.rounds for i in range(8)) > 0  # the oldest requests drafted
        assert "cannot hold every running request" in drafter.log()
        assert "Traceback" not in drafter.log() + verifier.log()
        assert read_metrics(verifier.metrics_port).get("tandem:drafter_failures_total", 0.0) == 0.0
        assert read_metrics(drafter.metrics_port)["tandem:drafter_requests_shed_total"] > 0
    finally:
        verifier.stop()
        drafter.stop()


def test_drafter_death_loses_nothing_and_speculation_resumes(pair_dirs, reference, tmp_path):
    drafter, verifier = start_pair(pair_dirs, tmp_path, verifier_args=("--drafter-deadline-ms", "3000"))
    try:
        ring = {s for s in shm_segments() if s.startswith(f"tandem-{verifier.proc.pid}-")}
        assert len(ring) == 1, "the verifier owns one ring segment"
        prompts = prompts_of(32)[:8]
        results, errors = {}, []

        def run(i):
            try:
                results[i] = generate(verifier.address, prompts[i], max_new_tokens=24)[0]
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        wait_for(lambda: read_metrics(verifier.metrics_port).get("tandem:spec_decode_num_drafts_total", 0) >= 4, 60,
                 "speculative rounds before the kill")
        drafter.kill()
        for t in threads:
            t.join(180)
        assert not errors
        assert [results[i] for i in range(8)] == reference[:8]
        assert ring <= shm_segments(), "the verifier's ring must outlive a drafter crash"
        wait_for(lambda: read_metrics(verifier.metrics_port)["tandem:drafter_up"] == 0.0, 30, "drafter_up to drop")

        restarted = Service("drafter", drafter.args, drafter.port, tmp_path / "drafter2.log").start()
        try:
            wait_for(lambda: read_metrics(verifier.metrics_port)["tandem:drafter_up"] == 1.0, 30, "reconnection")
            before = read_metrics(verifier.metrics_port)["tandem:spec_decode_num_drafts_total"]
            tokens, last = generate(verifier.address, prompts_of(32)[12])
            assert tokens == reference[12]
            assert last.spec.rounds > 0
            assert read_metrics(verifier.metrics_port)["tandem:spec_decode_num_drafts_total"] > before
        finally:
            restarted.stop()
    finally:
        verifier.stop()
        drafter.kill()
    assert not {s for s in shm_segments() if s.startswith(f"tandem-{verifier.proc.pid}-")}, "ring left in /dev/shm"


def test_running_requests_speculate_again_after_the_drafter_comes_back(pair_dirs, tmp_path):
    """A drafter restart loses the draft state of running requests; when it is back, they join it (their
    committed tokens' entries rebuilt there): long requests speculate again, and their outputs stay target-only
    greedy."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.draft_link import JOIN_MIN_TOKENS_LEFT
    from tandem.engine.llm_engine import LLMEngine
    from tandem.sampling import SamplingParams

    n, new_tokens = 12, 440  # context 512
    prompts = prompts_of(n)
    with LLMEngine(EngineConfig(model=str(pair_dirs / "target"))) as eng:
        want = [r.output_token_ids for r in eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens,
                                                                                  ignore_eos=True))]
    # Every step speculates: the subject is the reconnect, and a measured policy would rightly decode a
    # head that accepts little plainly (faster, so the requests could end before the drafter is back).
    drafter, verifier = start_pair(pair_dirs, tmp_path, verifier_args=("--drafter-deadline-ms", "3000",
                                                                        "--speculation-policy", "always"))
    try:
        results, errors, received = {}, [], [[0] for _ in range(n)]

        def run(i):
            try:
                results[i] = generate(verifier.address, prompts[i], max_new_tokens=new_tokens, progress=received[i])[0]
            except Exception as e:  # noqa: BLE001 - asserted below
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        drafts = lambda: read_metrics(verifier.metrics_port).get("tandem:spec_decode_num_drafts_total", 0)  # noqa: E731
        wait_for(lambda: drafts() >= 4, 60, "speculative rounds before the kill")
        drafter.kill()
        wait_for(lambda: read_metrics(verifier.metrics_port)["tandem:drafter_up"] == 0.0, 30, "drafter_up to drop")
        # The verifier stands still while the new drafter starts (its start-up, seconds on a loaded machine, would
        # otherwise let the requests decode to their end plainly): only its reconnection's wait is decoding time.
        os.kill(verifier.proc.pid, signal.SIGSTOP)
        try:
            restarted = Service("drafter", drafter.args, drafter.port, tmp_path / "drafter2.log").start()
        finally:
            os.kill(verifier.proc.pid, signal.SIGCONT)
        try:
            wait_for(lambda: read_metrics(verifier.metrics_port)["tandem:drafter_up"] == 1.0, 30, "reconnection")
            assert max(new_tokens - r[0] for r in received) >= 2 * JOIN_MIN_TOKENS_LEFT, \
                "the requests were about to finish when the drafter came back"
            back = drafts()
            for t in threads:
                t.join(180)
            assert drafts() > back, "the running requests speculated again after the reconnect"
        finally:
            restarted.stop()
        assert not errors
        assert [results[i] for i in range(n)] == want
    finally:
        verifier.stop()
        drafter.kill()


def test_a_verifier_with_the_head_in_process_equals_target_only_greedy(pair_dirs, reference, tmp_path):
    """--drafter in-process: no drafter service, the head drafts inside the verifier (the in-process
    engine's path), and the tokens are still the target's own greedy ones."""
    from tandem.service_probe import free_port

    metrics_port = free_port()
    verifier = Service("verifier", ["--model", str(pair_dirs / "target"), "--drafter", "in-process",
                                    "--draft-model", str(pair_dirs / "draft"), "--metrics-port", str(metrics_port),
                                    "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                                    "--speculative-num-draft-tokens", "5", "--speculation-policy", "always"],
                       free_port(), tmp_path / "verifier.log").start()
    try:
        assert "drafter in process" in verifier.log()
        for i in (3, 8):
            tokens, last = generate(verifier.address, prompts_of(32)[i])
            assert tokens == reference[i] and last.spec.rounds > 0
        assert read_metrics(metrics_port)["tandem:drafter_up"] == 1.0
    finally:
        verifier.stop()


def test_an_in_process_drafter_without_a_head_is_refused_in_one_line(pair_dirs, capsys):
    from verifier.__main__ import main

    assert main(["--model", str(pair_dirs / "target"), "--drafter", "in-process"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--draft-model" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags", [["--ring-rows", "16384"], ["--disable-round-lane"], ["--drafter-deadline-ms", "500"],
                                   ["--disable-round-prefetch"]])
def test_drafter_service_settings_with_an_in_process_head_are_refused(pair_dirs, capsys, flags):
    """They would be ignored: a deployment tuning them would believe they took effect."""
    from verifier.__main__ import main

    target, draft = str(pair_dirs / "target"), str(pair_dirs / "draft")
    assert main(["--model", target, "--drafter", "in-process", "--draft-model", draft, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and flags[0] in err and "in-process" in err


def test_a_tree_the_in_process_head_cannot_draft_is_refused_and_the_verifier_serves_on(pair_dirs, reference, tmp_path):
    """A request asking the in-process head for more top-k than it keeps is INVALID_ARGUMENT (it once
    stopped the engine loop); the verifier keeps serving."""
    from tandem.service_probe import free_port

    verifier = Service("verifier", ["--model", str(pair_dirs / "target"), "--drafter", "in-process",
                                    "--draft-model", str(pair_dirs / "draft"), "--speculation-policy", "always"],
                       free_port(), tmp_path / "verifier.log").start()
    try:
        with grpc.insecure_channel(verifier.address) as channel:
            stub = pb_grpc.VerifierStub(channel)
            request = pb.GenerateRequest(prompt_token_ids=prompts_of(32)[4], sampling=pb.SamplingParams(max_new_tokens=4),
                                         speculation=pb.SpeculationParams(topk=9, num_steps=2, num_draft_tokens=10))
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Generate(request, timeout=60))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculation.topk" in err.value.details()
        tokens, _ = generate(verifier.address, prompts_of(32)[4])
        assert tokens == reference[4]
    finally:
        verifier.stop()


def test_a_failing_in_process_head_leaves_the_engine_decoding_target_only_greedy(pair_dirs, reference):
    """GuardedHead: the head's recoverable failures (here its draft KV cache full) become
    ProposerUnavailable: the requests decode on without speculation, with the target's own tokens."""
    from tandem.engine.config import EngineConfig
    from tandem.errors import OutOfPagesError
    from tandem.sampling import SamplingParams
    from tandem.speculative.spec_config import SpecConfig
    from proposers import always_speculate
    from tandem.engine.speculative_setup import speculative_engine
    from verifier.in_process_head import GuardedHead

    engine = speculative_engine(EngineConfig(model=str(pair_dirs / "target")), str(pair_dirs / "draft"),
                                SpecConfig(3, 1, 4), policy=always_speculate())
    head = engine.proposer
    calls = {"draft": 0}
    real_draft = head.draft

    def draft_then_fail(rids, spec):
        calls["draft"] += 1
        if calls["draft"] == 3:
            raise OutOfPagesError("draft KV cache out of pages (injected)")
        return real_draft(rids, spec)

    head.draft = draft_then_fail
    engine.proposer = GuardedHead(head)
    with engine:
        outs = engine.generate(prompts_of(32)[:3], SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.output_token_ids for o in outs] == reference[:3]
    assert calls["draft"] >= 3 and not head._reqs  # failed once; the head forgot every request


def test_a_target_only_verifier_queuing_decode_steps_streams_what_one_step_decoding_makes(pair_dirs, reference,
                                                                                          tmp_path):
    """``--decode-steps 4`` (the GPU default; CPU runs default to 1): concurrent streams carry the
    tokens of one-step decoding, several per message, and a cancelled stream gives its pages back."""
    from tandem.service_probe import free_port

    metrics_port = free_port()
    verifier = Service("verifier", ["--model", str(pair_dirs / "target"), "--decode-steps", "4",
                                    "--metrics-port", str(metrics_port)], free_port(), tmp_path / "verifier.log").start()
    try:
        results: dict[int, tuple] = {}
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, generate(verifier.address, prompts_of(32)[i])))
                   for i in (1, 4, 7)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        for i, (tokens, last) in results.items():
            assert tokens == reference[i]
            assert last.finish_reason == "length" and last.completion_tokens == 24
        with grpc.insecure_channel(verifier.address) as channel:
            call = pb_grpc.VerifierStub(channel).Generate(pb.GenerateRequest(
                prompt_token_ids=prompts_of(32)[3], sampling=pb.SamplingParams(max_new_tokens=400, ignore_eos=True)))
            first, second = next(call), next(call)
            assert len(first.token_ids) + len(second.token_ids) >= 5  # the prefill's token, then a run of four
            call.cancel()
        wait_for(lambda: (lambda m: m["tandem:kv_pages_free"] == m["tandem:kv_pages_capacity"])(
                 read_metrics(metrics_port)),
                 30, "the cancelled request's KV pages to come back")
    finally:
        verifier.stop()


def _in_process_run(pair_dirs, prompt: list[int]):
    """The same request decoded by the in-process engine with the prefix cache off (the pair's head and
    speculation settings): → (tokens, accept length mean)."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.configs.eagle3 import DraftConfig, validate_draft
    from tandem.configs.model import ModelConfig
    from tandem.sampling import SamplingParams
    from tandem.speculative.drafter import DrafterConfig, Eagle3Drafter
    from tandem.speculative.spec_config import SpecConfig
    from proposers import always_speculate

    target, draft = str(pair_dirs / "target"), str(pair_dirs / "draft")
    capture = validate_draft(DraftConfig.from_dir(draft), ModelConfig.from_dir(target))
    with LLMEngine(EngineConfig(model=target, capture_layers=capture, enable_prefix_caching=False),
                   policy=always_speculate()) as eng:
        eng.proposer = Eagle3Drafter.from_dirs(draft, target, DrafterConfig(), capture_layers=capture,
                                               embed_weight=eng.executor.runner.model.model.embed_tokens.weight)
        eng.default_spec = SpecConfig(3, 2, 5)
        out = eng.generate([prompt], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    return out.output_token_ids, out.spec_stats.accept_length_mean


def test_a_prompt_on_a_cached_prefix_speculates_at_once_across_the_pair(pair, pair_dirs):
    """A second turn (the first's prompt and answer, then more) starts on the verifier's cached pages and
    on the drafter process's cached head pages: the target's own tokens, cached tokens reported, and the
    acceptance of a drafter that saw the whole prompt (the in-process engine with the cache off)."""
    drafter, verifier = pair
    before, drafter_before = read_metrics(verifier.metrics_port), read_metrics(drafter.metrics_port)
    first = [(11 * j) % 240 + 5 for j in range(45)]
    answer, last = generate(verifier.address, first)
    assert last.cached_tokens == 0
    second = first + answer + [(13 * j) % 240 + 5 for j in range(9)]
    tokens, last = generate(verifier.address, second)
    expected, accept_length = _in_process_run(pair_dirs, second)
    assert tokens == expected
    assert last.cached_tokens == (len(first) + len(answer) - 1) // 16 * 16 > 0  # its committed full pages
    assert last.spec.rounds > 0 and last.spec.accept_length_mean == pytest.approx(accept_length)
    after = read_metrics(verifier.metrics_port)
    hits = after["tandem:prefix_cache_hits_total"] - before.get("tandem:prefix_cache_hits_total", 0)
    assert hits == last.cached_tokens
    assert after["tandem:prefix_cache_queries_total"] - before.get("tandem:prefix_cache_queries_total", 0) == len(first) + len(second)
    # the drafter process's own prefix cache found the head's pages of the second turn's cached prefix
    d = read_metrics(drafter.metrics_port)
    head_hits = d["tandem:drafter_prefix_cache_hits_total"] - drafter_before.get("tandem:drafter_prefix_cache_hits_total", 0)
    assert 0 < head_hits <= last.cached_tokens
