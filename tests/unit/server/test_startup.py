"""The start-up thread warning: more torch threads than the affinity mask, the cgroup quota or the
host's load leave free names --threads; a fitting count says nothing."""

from __future__ import annotations

from celeris.server.startup import CpuBudget, thread_warning


def test_more_threads_than_the_affinity_mask():
    w = thread_warning(8, CpuBudget(affinity=2, quota=None, load=0.0))
    assert w is not None and "--threads 2" in w and "affinity" in w


def test_more_threads_than_the_cgroup_quota():
    w = thread_warning(4, CpuBudget(affinity=16, quota=2.5, load=0.0))
    assert w is not None and "--threads 2" in w and "quota of 2.5" in w


def test_a_loaded_host():
    w = thread_warning(4, CpuBudget(affinity=4, quota=None, load=3.2))
    assert w is not None and "load average is 3.2" in w and "--threads" in w


def test_threads_that_fit_say_nothing():
    assert thread_warning(3, CpuBudget(affinity=4, quota=None, load=0.5)) is None
    assert thread_warning(2, CpuBudget(affinity=16, quota=2.0, load=None)) is None
    assert thread_warning(1, CpuBudget(affinity=2, quota=None, load=9.0)) is None  # one thread cannot be fewer


def test_matmuls_that_round_rows_by_batch_are_warned_about(monkeypatch):
    from types import SimpleNamespace

    from celeris.server import startup

    class Log:
        def __init__(self):
            self.records: list[tuple[str, dict]] = []

        def info(self, event, **kw):
            self.records.append((event, kw))

        warning = info

    server = SimpleNamespace(port=50051, http=None, metrics_port=None)
    settings = SimpleNamespace(host="", ssl_certfile=None, metrics_host=None, metrics_on_http=False,
                               model_names=lambda name: [name])
    llm = SimpleNamespace(name="m", config=SimpleNamespace(device="cpu", dtype="float32"))
    quiet = CpuBudget(affinity=4, quota=None, load=0.0)
    for invariant, warned in ((True, False), (False, True)):
        monkeypatch.setattr(startup, "gemm_rows_invariant", lambda: invariant)
        log = Log()
        startup.log_startup(log, server, settings, llm, 1, quiet)
        events = [e for e, _ in log.records]
        assert ("celeris.batch_invariance" in events) is warned, events
        if warned:
            assert "MKL_CBWR=AUTO,STRICT" in dict(log.records)["celeris.batch_invariance"]["message"]
