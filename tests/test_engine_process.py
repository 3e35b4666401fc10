"""The verifier with its engine loop in a process of its own (``--engine-process``, verifier/engine_process.py), over
real sockets: what it serves is what the thread serves (target-only greedy, speculating in process, concurrent
streams), cancellations and refusals reach the right submission across the pipe, the metrics come from the engine's
process, and the engine process's end — killed, or the service stopped — is the service's, with nothing left behind.

References are independent of the services: target-only greedy decoding by the in-process engine.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from pathlib import Path

import grpc
import pytest

from services import Service, generate, process_running, prompts_of, read_metrics, wait_for
from tandem.rpc.verifier.v1 import verifier_pb2 as pb
from tandem.rpc.verifier.v1 import verifier_pb2_grpc as pb_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(pair_dirs):
    from helpers import target_only_greedy

    return target_only_greedy(pair_dirs / "target", prompts_of(8), 24)


def _verifier(pair_dirs, logs: Path) -> Service:
    verifier = Service("verifier", ["--model", str(pair_dirs / "target"), "--draft-model", str(pair_dirs / "draft"),
                                    "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                                    "--speculative-num-draft-tokens", "4", "--speculation-policy", "always",
                                    "--engine-process", "--metrics-port", str(metrics_port := _free_port())],
                       _free_port(), logs / "verifier.log")
    verifier.metrics_port = metrics_port
    return verifier.start()


def _free_port() -> int:
    from services import free_port

    return free_port()


def _engine_child(pid: int) -> int:
    """The verifier's engine process: its child started by multiprocessing's spawn (not its resource tracker)."""
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        if "spawn_main" in cmdline:
            return int(child)
    raise AssertionError(f"no engine process under {pid}")


@pytest.fixture(scope="module")
def verifier(pair_dirs, tmp_path_factory):
    service = _verifier(pair_dirs, tmp_path_factory.mktemp("logs"))
    yield service
    service.stop()


def test_concurrent_streams_speculate_and_equal_target_only_greedy(verifier, reference):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: generate(verifier.address, p), prompts_of(8)))
    assert [tokens for tokens, _ in results] == reference
    assert all(last.finish_reason == "length" and last.spec.rounds > 0 for _, last in results)
    m = read_metrics(verifier.metrics_port)  # (served by the engine's process)
    assert m["tandem:generation_tokens_total"] >= 8 * 24 and m["tandem:spec_decode_num_drafts_total"] > 0


def test_tp_2_in_an_engine_process_serves_target_only_greedy(pair_dirs, reference, tmp_path):
    """The default on GPUs (an engine process) with tensor parallelism: the child starts the ranks (gloo here)."""
    service = Service("verifier", ["--model", str(pair_dirs / "target"), "--tp-size", "2", "--engine-process"],
                      _free_port(), tmp_path / "verifier.log").start()
    try:
        child = _engine_child(service.proc.pid)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda p: generate(service.address, p), prompts_of(8)[:4]))
        assert [tokens for tokens, _ in results] == reference[:4]
    finally:
        service.stop()
    wait_for(lambda: not process_running(child), 30, "the engine process (and its ranks) to end")


def test_a_cancelled_stream_frees_its_kv_and_a_duplicate_id_leaves_the_running_one_alone(verifier, reference):
    with grpc.insecure_channel(verifier.address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        long = pb.GenerateRequest(request_id="dup", prompt_token_ids=prompts_of(8)[0],
                                  sampling=pb.SamplingParams(max_new_tokens=400, ignore_eos=True))
        running = stub.Generate(long, timeout=120)
        next(running)  # it runs
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(request_id="dup", prompt_token_ids=[5, 6, 7],
                                                  sampling=pb.SamplingParams(max_new_tokens=4)), timeout=30))
        assert refused.value.code() == grpc.StatusCode.ALREADY_EXISTS
        more = next(running)  # the refused duplicate's cancellation did not reach the running one
        assert more.token_ids and not more.finish_reason
        running.cancel()
    wait_for(lambda: (lambda m: m["tandem:num_requests_running"] == 0
                      and m["tandem:kv_pages_free"] == m["tandem:kv_pages_capacity"])(
                 read_metrics(verifier.metrics_port)),
             30, "the cancelled request's KV to be freed")
    tokens, _ = generate(verifier.address, prompts_of(8)[2])  # serving on
    assert tokens == reference[2]


def test_stopping_the_service_ends_its_engine_process(pair_dirs, tmp_path):
    service = _verifier(pair_dirs, tmp_path)
    child = _engine_child(service.proc.pid)
    assert service.stop() == 0
    wait_for(lambda: not process_running(child), 10, "the engine process to end")


def test_an_engine_process_that_dies_fails_its_streams_and_the_service_exits_to_be_restarted(pair_dirs, tmp_path):
    from tandem.watchdog import ENGINE_FAILED_EXIT_CODE

    service = _verifier(pair_dirs, tmp_path)
    try:
        child = _engine_child(service.proc.pid)
        with grpc.insecure_channel(service.address) as channel:
            running = pb_grpc.VerifierStub(channel).Generate(pb.GenerateRequest(
                prompt_token_ids=prompts_of(8)[1], sampling=pb.SamplingParams(max_new_tokens=400, ignore_eos=True)),
                timeout=120)
            next(running)
            os.kill(child, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as ended:
                for _ in running:
                    pass
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        deadline = time.monotonic() + 60
        while service.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert service.proc.returncode == ENGINE_FAILED_EXIT_CODE, service.log()
        assert "the engine process ended" in service.log()
    finally:
        service.stop()


def test_ctrl_c_to_the_group_drains_and_a_killed_server_takes_its_engine_process_with_it(pair_dirs, tmp_path):
    """A terminal's Ctrl-C reaches every process of the group: the server drains and stops its engine process in
    order (exit 0, no traceback from the child). And a server killed outright: its engine process sees the pipe end
    and stops too, nothing left in /dev/shm."""
    import subprocess
    import sys

    from services import ROOT, free_port, shm_segments
    from tandem.service_probe import wait_serving

    def start():
        port = free_port()
        log = open(tmp_path / f"verifier-{port}.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "verifier", "--model", str(pair_dirs / "target"), "--port",
                                 str(port), "--engine-process"], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_serving(port, 90, proc, "verifier")
        return proc, tmp_path / f"verifier-{port}.log"

    before = shm_segments()
    proc, log = start()
    child = _engine_child(proc.pid)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(60) == 0, log.read_text()
    wait_for(lambda: not process_running(child), 10, "the engine process to end")
    assert "Traceback" not in log.read_text(), log.read_text()

    proc, log = start()
    child = _engine_child(proc.pid)
    proc.kill()
    proc.wait(10)
    wait_for(lambda: not process_running(child), 30, "the orphaned engine process to end")
    wait_for(lambda: shm_segments() <= before, 10, "its shared memory to go")


def test_cancelled_submissions_leave_nothing_behind_on_either_side(pair_dirs):
    """Streams cancelled at every point (before the engine took them, while they run) and streams that finish: the
    server's side keeps no submission afterwards (a cancelled one gets no last output to clear it)."""
    from verifier.config import VerifierConfig
    from tandem.engine.config import EngineConfig
    from verifier.engine_api import Submission
    from verifier.engine_process import EngineProcess
    from tandem.sampling import SamplingParams

    engine = EngineProcess(VerifierConfig(EngineConfig(model=str(pair_dirs / "target")), log_stats_interval_s=0.0))
    engine.start()
    try:
        engine.built.result(120)
        outputs = {}
        subs = []
        for i in range(12):
            got = outputs[f"r{i}"] = []
            sub = Submission(f"r{i}", prompts_of(8)[i % 8], SamplingParams(max_new_tokens=64 if i % 3 else 4,
                                                                            ignore_eos=True), None, got.append)
            subs.append(sub)
            engine.submit(sub)
            if i % 3 == 1:  # at once: before or just after the engine took it
                engine.cancel(sub.rid, sub)
        for sub in subs:
            sub.added.result(30)
        for sub in subs[2::3]:  # while running
            engine.cancel(sub.rid, sub)
        wait_for(lambda: all(outputs[s.rid] and outputs[s.rid][-1].finish_reason for s in subs[0::3]), 60,
                 "the short requests to finish")
        wait_for(lambda: not engine._subs, 10, "the server's side to forget every submission")
    finally:
        engine.stop()
        engine.join(30)
    assert not engine.is_alive() and engine.fatal is None


def test_a_start_that_fails_after_the_tp_ranks_began_ends_the_service_and_its_ranks(pair_dirs, tmp_path):
    """--capture-traffic into a path that cannot be a folder fails the start after the engine (TP 2: a rank process)
    is up: the engine process must take its ranks down and end (multiprocessing's own exit waited for the rank, which
    ignores SIGTERM, without end), and the service exit with the error."""
    import subprocess
    import sys

    from services import ROOT

    proc = subprocess.Popen([sys.executable, "-m", "verifier", "--model", str(pair_dirs / "target"), "--port", "0",
                             "--tp-size", "2", "--capture-traffic", "/etc/passwd/x", "--engine-process"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("the verifier did not end after its engine's start failed")
    assert proc.returncode != 0 and "Not a directory" in out, out
    def running():  # (of its session: the engine process, its rank; an ended one awaiting its reaping is gone)
        found = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
        return [pid for pid in found if process_running(int(pid))]

    wait_for(lambda: not running(), 15, "the failed start's processes to end")


def test_a_hang_the_childs_watchdog_caught_keeps_its_exit_code_for_the_server():
    """A hang on the engine's thread exits the verifier 75 (HUNG_EXIT_CODE); in a process of its own the child exits 75
    and the server, which exited 3 like any engine failure, now says hung and exits 75 too."""
    from tandem.watchdog import ENGINE_FAILED_EXIT_CODE, HUNG_EXIT_CODE
    from verifier.engine_api import EngineFailed
    from verifier.engine_process import _child_ended

    hung, killed = _child_ended(HUNG_EXIT_CODE), _child_ended(-9)
    assert "hung" in str(hung) and "exit code -9" in str(killed)
    assert EngineFailed(hung).exit_code == HUNG_EXIT_CODE
    assert EngineFailed(killed).exit_code == ENGINE_FAILED_EXIT_CODE
    assert EngineFailed(RuntimeError("a step raised")).exit_code == ENGINE_FAILED_EXIT_CODE


def test_a_steps_outputs_cross_the_pipe_with_every_field():
    """A step's outputs go to the server's process as tuples of their fields (verifier/engine_process.py): what
    arrives is the output that was sent, every field set to something other than its default."""
    import pickle

    from tandem.engine.request import FinishReason
    from tandem.engine.step import StepOutput
    from tandem.logprobs import TokenLogprobs
    from tandem.speculative.stats import SpecStats
    from verifier.engine_api import Submission
    from verifier.engine_child import _PipeSink
    from verifier.engine_process import EngineProcess

    class Outbox:
        def __init__(self):
            self.live, self.sent = {7: None, 8: None}, []

        def send(self, message):
            self.sent.append(pickle.loads(pickle.dumps(message)))  # (as the pipe carries it)

    sent = [StepOutput("a", [5, 6], FinishReason.LENGTH, drafted=3, spec_stats=SpecStats(2, [1, 2], [2, 2], [2, 1]),
                       round_accepts=[1, 2], logprobs=[TokenLogprobs(-0.5, ((5, -0.5),)), TokenLogprobs(-1.0, ())],
                       prompt_logprobs=[TokenLogprobs(-2.0, ((3, -1.5),))], cached_tokens=16),
            StepOutput("b", [9], None)]
    outbox = Outbox()
    _PipeSink.deliver(outbox, [(7, sent[0]), (8, sent[1])])
    assert outbox.live == {8: None}  # the finished one is no longer cancellable there
    received = []
    process = EngineProcess(cfg=None)
    for number, rid in ((7, "a"), (8, "b")):
        sub = Submission(rid, [1], None, None, received.append)
        sub.added.set_result(rid)
        process._subs[number] = sub
    (kind, items), = outbox.sent
    process._outputs(items)
    assert kind == "outputs" and received == sent
    assert list(process._subs) == [8]  # the finished submission's books closed
