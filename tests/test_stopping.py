"""A worker told to stop ends its writes to the cluster at once (webhook.serving.stopping): the callbacks run when
SIGTERM arrives, each once, a callback registered afterwards runs at once, and gunicorn's worker wires it to its
SIGTERM handler. Each test runs in a child process: the module keeps process-wide state, as a worker does."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=60, check=False, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_callbacks_run_once_when_the_stop_begins_and_a_late_one_at_once() -> None:
    out = run("""
        import threading
        from webhook.serving import stopping
        ran = []
        done = threading.Semaphore(0)
        def callback(name):
            def call():
                ran.append(name)
                done.release()
            return call
        stopping.on_stop(callback("audit"))
        print(stopping.requested(), ran)
        stopping.begin_stop()
        stopping.begin_stop()  # a second SIGTERM
        assert done.acquire(timeout=10)
        stopping.on_stop(callback("late"))
        assert done.acquire(timeout=10)
        assert not done.acquire(timeout=0.5)  # nothing ran twice
        print(stopping.requested(), ran)
    """)
    assert out.splitlines() == ["False []", "True ['audit', 'late']"]


def test_a_failing_callback_does_not_stop_the_others() -> None:
    out = run("""
        import threading
        from webhook.serving import stopping
        done = threading.Event()
        def broken():
            raise RuntimeError("the apiserver is away")
        stopping.on_stop(broken)
        stopping.on_stop(done.set)
        stopping.begin_stop()
        print(done.wait(10))
    """)
    assert out.strip() == "True"


def test_the_workers_sigterm_handler_begins_the_stop() -> None:
    out = run("""
        import signal
        from webhook.serving import stopping
        from webhook.serving.wholerequest import WholeRequestWorker
        worker = WholeRequestWorker.__new__(WholeRequestWorker)  # only its signal handler is exercised
        worker.alive = True
        class Queue:
            def defer(self, callback):
                pass
        worker.method_queue = Queue()
        worker.handle_exit(signal.SIGTERM, None)
        print(worker.alive, stopping.requested())
    """)
    assert out.strip() == "False True"
