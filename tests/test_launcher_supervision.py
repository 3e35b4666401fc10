"""`tandem up`'s supervision: a service that exits is started again after a back-off that doubles
(0.5 s to 10 s) and starts over once the service had run stably; the others are left alone."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from services import process_running

from tandem.supervision import Backoff, Child, stop_all, supervise


def test_backoff_doubles_to_its_ceiling_and_resets_after_a_stable_run():
    b = Backoff(first_s=0.5, most_s=10.0, stable_s=60.0)
    assert [b.delay(ran_s=1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert b.delay(ran_s=61.0) == 0.5  # it had run for a minute: a fresh failure, not a crash loop
    assert b.delay(ran_s=0.1) == 1.0


class _TimedChild(Child):
    """A Child that notes when each of its starts happened."""

    def start(self, env: dict) -> None:
        super().start(env)
        self.starts_at = [*getattr(self, "starts_at", []), self.started_at]


def test_a_dying_service_is_restarted_with_backoff_and_the_others_keep_running(tmp_path, caplog):
    starts = tmp_path / "starts"
    crasher = _TimedChild("drafter", [sys.executable, "-c",
                                      f"open({str(starts)!r}, 'a').write('x'); import os; os.kill(os.getpid(), 9)"],
                          backoff=Backoff(first_s=0.2, most_s=0.8, stable_s=60.0))
    steady = Child("verifier", [sys.executable, "-c", "import time; time.sleep(60)"])
    children = [crasher, steady]
    for child in children:
        child.start(dict(os.environ))
    steady_pid = steady.proc.pid
    done = threading.Event()
    supervisor = threading.Thread(target=supervise, args=(children, dict(os.environ), 0.05, done.is_set))
    caplog.set_level(logging.WARNING, logger="tandem.up")
    supervisor.start()
    # Polled, not a fixed time: each start of the crasher is a Python start-up, seconds on a busy machine.
    # Unloaded: delays 0.2, 0.4, 0.8, 0.8 (+ start-up of each), ~2.3 s.
    deadline = time.monotonic() + 60
    try:
        while crasher.restarts < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        supervisor.join(30)
        stop_all(children)
    assert not supervisor.is_alive()
    assert crasher.restarts >= 4, crasher.restarts  # (one more may start between the poll and the stop)
    # each start came at least its back-off after the one before (that one died at once): 0.2 doubling to 0.8,
    # not an immediate restart loop (dozens of restarts)
    gaps = [b - a for a, b in zip(crasher.starts_at, crasher.starts_at[1:])]
    assert len(gaps) == crasher.restarts
    assert all(gap >= min(0.2 * 2 ** i, 0.8) for i, gap in enumerate(gaps)), gaps
    assert len(starts.read_text()) in (crasher.restarts, crasher.restarts + 1)  # each restart really ran it (the last may be stopped first)
    assert steady.proc.pid == steady_pid and steady.restarts == 0
    # each exit and restart is a timestamped WARNING line of tandem.up (among the services' lines in one log)
    lines = [(r.name, r.levelname, r.getMessage()) for r in caplog.records]
    assert ("tandem.up", "WARNING", "drafter exited (killed by SIGKILL); restarting it in 0.2 s") in lines
    assert ("tandem.up", "WARNING", "restarting drafter (restart 1)") in lines




@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_services_stop_when_the_launcher_is_killed_outright():
    """A SIGKILLed `tandem up` runs no clean-up of its own: its services must not outlive it (each asks for its
    parent-death signal first thing in its main: the child here does as they do)."""
    service_main = "import time; from tandem.service_runtime import die_with_launcher; die_with_launcher(); time.sleep(120)"
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import os, sys, time\nfrom tandem.supervision import Child\n"
         f"c = Child('verifier', [sys.executable, '-c', {service_main!r}])\n"
         "c.start(dict(os.environ)); print(c.proc.pid, flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    service = int(launcher.stdout.readline())
    assert process_running(service)
    launcher.kill()
    launcher.wait(10)
    deadline = time.monotonic() + 30  # polled: at once unless the machine is busy
    while process_running(service) and time.monotonic() < deadline:
        time.sleep(0.05)
    if process_running(service):
        os.kill(service, 9)
        raise AssertionError("the service outlived its killed launcher")


def test_services_are_started_without_a_hook_between_fork_and_exec(monkeypatch):
    """A ``preexec_fn`` makes each start a plain fork whose child runs gRPC's fork handlers (the launcher probes health
    over gRPC): 3 children in 150 aborted before their exec on this machine (grpcio 1.85). A service started by the
    launcher gets the launcher's pid instead and asks for its parent-death signal itself."""
    from tandem import supervision
    from tandem.service_runtime import LAUNCHER_PID_ENV

    seen = {}
    monkeypatch.setattr(supervision.subprocess, "Popen", lambda argv, **kwargs: seen.update(kwargs) or object())
    Child("gateway", ["gateway"]).start({"PATH": "/bin"})
    assert seen.get("preexec_fn") is None and seen["env"] == {"PATH": "/bin", LAUNCHER_PID_ENV: str(os.getpid())}


def test_only_the_gateway_is_given_the_api_key(monkeypatch):
    from tandem import supervision
    from tandem.args import API_KEY_ENV

    seen = {}
    monkeypatch.setattr(supervision.subprocess, "Popen", lambda argv, **kwargs: seen.update({argv[0]: kwargs["env"]}))
    for name in ("drafter", "verifier", "gateway"):
        Child(name, [name]).start({"PATH": "/bin", API_KEY_ENV: "sk-1"})
    assert [API_KEY_ENV in seen[name] for name in ("drafter", "verifier", "gateway")] == [False, False, True]


def test_one_service_name_for_the_stack_names_each_service_apart(monkeypatch):
    """(OTEL_SERVICE_NAME given to tandem up, by an operator's injection say: each service's spans still told apart.)"""
    from tandem import supervision

    seen = {}
    monkeypatch.setattr(supervision.subprocess, "Popen", lambda argv, **kwargs: seen.update({argv[0]: kwargs["env"]}))
    for name in ("drafter", "verifier", "gateway"):
        Child(name, [name]).start({"PATH": "/bin", "OTEL_SERVICE_NAME": "chat-prod"})
    assert [seen[name]["OTEL_SERVICE_NAME"] for name in ("drafter", "verifier", "gateway")] == [
        "chat-prod-drafter", "chat-prod-verifier", "chat-prod-gateway"]
    Child("gateway", ["gateway"]).start({"PATH": "/bin"})
    assert "OTEL_SERVICE_NAME" not in seen["gateway"]  # (unset: each service's default name)


@pytest.mark.parametrize("service", ["verifier", "drafter", "gateway"])
def test_each_service_asks_for_its_parent_death_signal_first(service, monkeypatch):
    import importlib

    module = importlib.import_module(f"{service}.__main__")
    called = []
    monkeypatch.setattr(module, "die_with_launcher", lambda: called.append(True))
    with pytest.raises(SystemExit):
        module.main(["--no-such-flag"])
    assert called == [True]


def test_a_launcher_started_under_nohup_keeps_running_on_sighup(tmp_path):
    up, service_pid = _up_with_one_service(tmp_path, "SIGHUP")
    try:
        up.send_signal(signal.SIGHUP)
        time.sleep(1.0)
        assert up.poll() is None and process_running(service_pid)
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0, up.stderr.read()
    finally:
        up.kill()


def _supervised(children, seconds_or_until, healthy):
    """supervise over ``children`` (started here) until ``seconds_or_until()`` is true; then all stopped."""
    for child in children:
        child.start(dict(os.environ))
    done = threading.Event()
    supervisor = threading.Thread(target=supervise, args=(children, dict(os.environ), 0.05, done.is_set),
                                  kwargs=dict(healthy=healthy))
    supervisor.start()
    deadline = time.monotonic() + 60
    try:
        while not seconds_or_until() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        done.set()
        supervisor.join(30)
        stop_all(children)


def test_a_restarted_service_is_said_to_serve_again(caplog):
    child = Child("drafter", [sys.executable, "-c", "import time; time.sleep(0.3)"],
                  backoff=Backoff(first_s=0.1, most_s=0.1, stable_s=60.0))
    caplog.set_level(logging.INFO, logger="tandem.up")
    said = lambda: any("drafter serves again" in r.getMessage() for r in caplog.records)  # noqa: E731
    _supervised([child], said, healthy=lambda c: c.proc.poll() is None)
    assert said() and child.restarts >= 1


def test_a_run_that_never_served_is_no_stable_run(tmp_path):
    """A service that loads for longer than the stable time and then crashes, again and again, backs off; it restarted
    at the first delay each time (the stable time counted from its start, not from when it served)."""
    child = _TimedChild("verifier", [sys.executable, "-c", "import time; time.sleep(0.4)"],
                        backoff=Backoff(first_s=0.1, most_s=0.8, stable_s=0.2))
    _supervised([child], lambda: child.restarts >= 3, healthy=lambda c: False)
    delays = [b - a - 0.4 for a, b in zip(child.starts_at, child.starts_at[1:])]
    assert delays[2] >= 0.4 - 0.05, delays  # 0.1, 0.2, 0.4: doubled, not 0.1 each time


def _up_with_one_service(tmp_path, ignored: str, stuck: bool = False) -> tuple[subprocess.Popen, int]:
    """A launcher (run_up, the services' plan replaced by one sleeping process) started with signal ``ignored``
    set to be ignored, as a shell or nohup starts it; → the launcher and its service's pid once it runs. ``stuck``: the
    service ignores SIGTERM (the launcher kills it 1 s after asking it to stop)."""
    pid_file = tmp_path / "service.pid"
    service = ("import os, signal, time; " + ("signal.signal(signal.SIGTERM, signal.SIG_IGN); " if stuck else "")
               + f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)")
    script = (
        "import signal, sys\n"
        f"signal.signal(signal.{ignored}, signal.SIG_IGN)\n"
        "from types import SimpleNamespace\n"
        "import tandem.launcher as launcher, tandem.supervision as supervision\n"
        "supervision.STOP_NOTICE_S, supervision.STOP_TIMEOUT_S = 0.3, 1.0\n"
        f"kids = [supervision.Child('verifier', [sys.executable, '-c', {service!r}])]\n"
        "launcher.plan_up = lambda args, secret: launcher.UpPlan(kids, {'metrics': 1, 'drafter': 2}, 'm', 'm', None)\n"
        "launcher._wait_healthy = lambda *a, **k: None\n"
        "launcher._check_gateway = lambda *a: None\n"
        "args = SimpleNamespace(api_key=None, model='m', device='cpu', host='127.0.0.1', port=1, grpc_port=2,\n"
        "                       drafter='service')\n"
        "sys.exit(launcher.run_up(args))\n")
    up = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return up, int(pid_file.read_text())


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGHUP])
def test_sigint_and_sighup_stop_the_stack_in_order(tmp_path, signum):
    """A shell starts a background job with SIGINT ignored; the services handle SIGINT themselves, so a SIGINT to
    the group stopped them and the launcher, staying up, restarted them. `tandem up` stops on SIGINT always; and on
    SIGHUP (the terminal of a foreground `tandem up` closed: it exited 129 at once, the services racing to stop)."""
    up, service_pid = _up_with_one_service(tmp_path, "SIGINT")
    up.send_signal(signum)
    try:
        assert up.wait(30) == 0, up.stderr.read()
    finally:
        up.kill()
    deadline = time.monotonic() + 30
    while process_running(service_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_running(service_pid)


def test_a_stop_that_had_to_kill_exits_1_naming_what_it_killed(tmp_path):
    """An operator's script must see that the stop was not clean."""
    up, service_pid = _up_with_one_service(tmp_path, "SIGHUP", stuck=True)
    up.send_signal(signal.SIGINT)
    try:
        assert up.wait(30) == 1
        err = up.stderr.read()
    finally:
        up.kill()
    assert "stopped; killed: verifier" in err, err
    assert not process_running(service_pid)


@pytest.mark.parametrize("flags, says", [
    (["--max-tokens-limit", "0"], "--max-tokens-limit must be at least 1"),
    (["--gateway-args", "--chat-template '{{ bad'"], "not a valid Jinja template"),
])
def test_the_gateways_settings_are_refused_before_any_service_starts(flags, says):
    """The gateway starts last, after the models' load: its refusals come first, from the gateway's own checks."""
    started = time.monotonic()
    up = subprocess.run([sys.executable, "-m", "tandem.cli", "up", "--device", "cpu", *flags], capture_output=True,
                        text=True, timeout=120)
    assert up.returncode != 0 and says in up.stderr.splitlines()[-1], up.stderr
    assert "starting drafter" not in up.stderr and "starting verifier" not in up.stderr
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("port_flag", ["--port", "--grpc-port"])
def test_a_taken_gateway_port_is_refused_before_any_service_starts(port_flag):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = subprocess.run([sys.executable, "-m", "tandem.cli", "up", "--device", "cpu", port_flag, str(port)],
                            capture_output=True, text=True, timeout=120)
    last = up.stderr.splitlines()[-1]
    assert up.returncode != 0 and "the gateway refuses its settings: cannot listen on" in last, up.stderr
    assert str(port) in last and "starting verifier" not in up.stderr


def test_services_stop_in_order_each_after_the_one_that_depends_on_it_has_exited(tmp_path):
    """The gateway drains its streams before the verifier stops (the verifier stopping with it cut the streams being
    drained, each client told the model server was unavailable); then the drafter."""
    script = ("import signal, sys, time\n"
              "def stop(*_):\n"
              "    open(sys.argv[1], 'a').write(f'term {time.monotonic()}\\n')\n"
              "    time.sleep(float(sys.argv[2]))\n"
              "    open(sys.argv[1], 'a').write(f'exit {time.monotonic()}\\n')\n"
              "    sys.exit(0)\n"
              "signal.signal(signal.SIGTERM, stop)\n"
              "open(sys.argv[1], 'a').write('up\\n')\n"
              "while True: time.sleep(0.05)\n")
    logs = {name: tmp_path / name for name in ("drafter", "verifier", "gateway")}
    children = [Child(name, [sys.executable, "-c", script, str(log), "0.3" if name == "gateway" else "0"])
                for name, log in logs.items()]
    for child in children:
        child.start(dict(os.environ))
    deadline = time.monotonic() + 30
    while not all(log.exists() for log in logs.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop_all(children)

    def at(name, what):
        return next(float(line.split()[1]) for line in logs[name].read_text().splitlines() if line.startswith(what))

    assert at("gateway", "exit") <= at("verifier", "term") and at("verifier", "exit") <= at("drafter", "term")
    assert all(child.proc.returncode == 0 for child in children)


def test_a_service_that_does_not_stop_is_named_then_killed(tmp_path, monkeypatch, capsys):
    """A stuck service's stop was a silence of 30 s and a kill nobody was told of."""
    from tandem import supervision

    monkeypatch.setattr(supervision, "STOP_NOTICE_S", 0.3)
    monkeypatch.setattr(supervision, "STOP_TIMEOUT_S", 1.0)
    ready = tmp_path / "ready"
    stuck = Child("verifier", [sys.executable, "-c", "import signal, sys, time\n"
                                                     "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                                     "open(sys.argv[1], 'w').close()\n"
                                                     "time.sleep(60)\n", str(ready)])
    stuck.start(dict(os.environ))
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline:  # (its handler set before it is told to stop)
        time.sleep(0.05)
    assert stop_all([stuck]) == ["verifier"]
    err = capsys.readouterr().err
    assert stuck.proc.poll() is not None
    assert "waiting for verifier to stop (killed 1 s from now" in err and "verifier did not stop within 1 s: killed" in err
