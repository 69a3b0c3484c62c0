"""CPU threads (issue 38, item 8): torch runs on the CPUs this process may use (its affinity
mask capped by a cgroup quota), and OpenMP's threads wait passively, so a busy core does not
stall every parallel region."""

import os
import subprocess
import sys
import time

import pytest

from batchgen.job.threads import ThreadGovernor, cpu_threads

CPUS = len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("v2", "v1", "want"),
    [
        ("50000 100000\n", None, 1),  # half a CPU: one thread
        ("150000 100000\n", None, min(CPUS, 2)),  # one and a half: two, if the mask allows
        ("max 100000\n", None, CPUS),  # no quota: the mask
        (None, ("50000", "100000"), 1),  # cgroup v1's quota
        (None, ("-1", "100000"), CPUS),  # v1 without one
        (None, None, CPUS),  # no cgroup files at all
    ],
)
def test_threads_are_the_affinity_mask_capped_by_the_cgroup_quota(tmp_path, v2, v1, want):
    cpu_max, v1_dir = tmp_path / "cpu.max", tmp_path / "cpu"
    if v2 is not None:
        cpu_max.write_text(v2)
    if v1 is not None:
        v1_dir.mkdir()
        (v1_dir / "cpu.cfs_quota_us").write_text(v1[0])
        (v1_dir / "cpu.cfs_period_us").write_text(v1[1])
    assert cpu_threads(cpu_max, v1_dir) == want


def test_one_cpu_of_affinity_is_one_thread_and_waits_spin_briefly():
    """taskset's mask (Slurm binds CPUs so too) gives one thread; importing batchgen makes
    OpenMP's threads spin 0.1 ms before sleeping (set before torch loads OpenMP), and a wait
    policy or spin count the user set is kept."""
    code = (
        "import os, sys, batchgen, torch\n"
        "from batchgen.job.threads import cpu_threads\n"
        "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
        "e = os.environ.get\n"
        "print(cpu_threads(), e('GOMP_SPINCOUNT'), e('OMP_WAIT_POLICY'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def run(**extra: str) -> list[str]:
        r = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env | extra
        )
        return r.stdout.split() or [r.stderr]

    assert run() == ["1", "10000", "None"]
    assert run(OMP_WAIT_POLICY="PASSIVE") == ["1", "None", "PASSIVE"]
    assert run(GOMP_SPINCOUNT="0") == ["1", "0", "None"]


def test_a_job_without_threads_runs_on_cpu_threads(model, tmp_path, monkeypatch):
    """`batchgen run` without --threads sets torch's count to cpu_threads(); --threads wins."""
    from helpers import prompt_file, run_job

    seen = []
    monkeypatch.setattr("batchgen.runner.run.cpu_threads", lambda: 3)
    monkeypatch.setattr("torch.set_num_threads", seen.append)
    run_job(prompt_file(tmp_path, 2), tmp_path / "a", model, "--max-new-tokens", 2)
    run_job(prompt_file(tmp_path, 2), tmp_path / "b", model, "--max-new-tokens", 2, "--threads", 1)
    assert seen[0] == 3 and seen[-1] == 1, seen


class FakeMachine:
    """A clock, the CPUs' busy ticks (100 a second) and this process's CPU seconds, moved by
    hand: `run(seconds, own=cpus, other=cpus)`."""

    def __init__(self) -> None:
        self.t, self.busy, self.own = 0.0, 0, 0.0

    def run(self, seconds: float, own: float, other: float) -> None:
        self.t += seconds
        self.own += own * seconds
        self.busy += round((own + other) * seconds * os.sysconf("SC_CLK_TCK"))

    def governor(self, most: int, seen: list[int]) -> ThreadGovernor:
        return ThreadGovernor(
            most,
            seen.append,
            every_s=1.0,
            busy_ticks=lambda: self.busy,
            own_seconds=lambda: self.own,
            clock=lambda: self.t,
        )


def test_governor_gives_up_a_cpu_another_process_holds_and_takes_it_back():
    """Another process's whole CPU takes a thread off after two readings that agree; half a
    second of it once moves nothing; when it ends the thread comes back."""
    m, seen = FakeMachine(), []
    g = m.governor(2, seen)
    for _ in range(3):  # quiet: this job alone on both CPUs
        m.run(1.0, own=1.9, other=0.05)
        assert g.tick() == 2
    m.run(1.0, own=1.4, other=0.6)  # a burst: one reading says 1 ...
    assert g.tick() == 2
    m.run(1.0, own=1.9, other=0.1)  # ... the next says 2 again: nothing changes
    assert g.tick() == 2 and seen == []
    for _ in range(2):  # a busy loop starts on one CPU
        m.run(1.0, own=1.3, other=0.7)
        g.tick()
    assert g.threads == 1 and seen == [1]
    for _ in range(3):  # it keeps its CPU: one thread stays
        m.run(1.0, own=1.0, other=1.0)
        assert g.tick() == 1
    for _ in range(2):  # it ends
        m.run(1.0, own=1.0, other=0.0)
        g.tick()
    assert g.threads == 2 and seen == [1, 2] and g.changes == 2 and g.fewest == 1


def test_governor_reads_the_machine_only_every_interval_and_never_goes_below_one():
    m, seen = FakeMachine(), []
    g = m.governor(4, seen)
    m.run(0.5, own=0.0, other=4.0)  # under a second: not read
    assert g.tick() == 4 and g._last[0] == 0.0
    for _ in range(2):
        m.run(1.0, own=0.5, other=3.5)  # everything else takes 3.5 of 4 CPUs
        g.tick()
    assert g.threads == 1 and seen == [1]
    for _ in range(2):
        m.run(1.0, own=1.0, other=1.2)  # one CPU taken: three threads
        g.tick()
    assert seen == [1, 3]
    m.run(2.5, own=3.0, other=0.0)  # one reading over two intervals (a model's load): enough
    assert g.tick() == 4 and seen == [1, 3, 4]


def test_governor_sees_a_real_busy_process_on_one_of_its_cpus():
    """/proc/stat read for real: a busy loop pinned to one of this process's CPUs shows as
    other processes' work (the rest of the machine's load only adds to it)."""
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc/stat")
    cpu = min(os.sched_getaffinity(0))
    loop = f"import os; os.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"
    busy = subprocess.Popen([sys.executable, "-c", loop])
    try:
        time.sleep(0.5)  # started and spinning
        g = ThreadGovernor(2, lambda n: None, every_s=0.0)
        before = g._read()
        time.sleep(1.0)  # this process sleeps: all the busy work is others'
        other = g.other_cpus(before, g._read())
    finally:
        busy.kill()
        busy.wait()
    assert other is not None and other >= 0.6, other


def test_a_job_without_threads_is_governed_between_steps(model, tmp_path, monkeypatch):
    """A CPU job of default threads ticks its governor after every step; --threads fixes the
    count, so no governor."""
    from helpers import prompt_file, run_job

    made: list[ThreadGovernor] = []

    class Counting(ThreadGovernor):
        def __init__(self, *a, **k) -> None:
            super().__init__(*a, **k)
            self.ticks = 0
            made.append(self)

        def tick(self) -> int:
            self.ticks += 1
            return super().tick()

    monkeypatch.setattr("batchgen.runner.run.ThreadGovernor", Counting)
    run_job(prompt_file(tmp_path, 3), tmp_path / "a", model, "--max-new-tokens", 4)
    assert len(made) == 1 and made[0].ticks >= 4, [g.ticks for g in made]
    run_job(prompt_file(tmp_path, 3), tmp_path / "b", model, "--max-new-tokens", 4, "--threads", 2)
    assert len(made) == 1


def test_the_python_api_governs_its_threads_and_puts_them_back(model, monkeypatch):
    """LLM on the CPU ticks a governor after each step, which may move torch's thread count;
    close() puts back the count it found."""
    import torch

    from batchgen import LLM, SamplingParams

    ticks = []
    monkeypatch.setattr(ThreadGovernor, "tick", lambda self: ticks.append(1) or self.threads)
    before = torch.get_num_threads()
    llm = LLM(model, device="cpu")
    assert llm._governor is not None and llm._governor.most == before
    llm.generate(["a b c"], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(ticks) >= 3
    torch.set_num_threads(1)  # as the governor does on a busy machine
    llm.close()
    assert torch.get_num_threads() == before


def test_a_compiled_job_keeps_its_threads():
    """Inductor's C++ kernels are built for one thread count and dynamo guards on it: a
    compiled job is not governed (a change would recompile its forward), nor a fixed count, a
    GPU job or tensor-parallel ranks."""
    from types import SimpleNamespace

    import torch

    from batchgen.runner.run import _thread_governor

    def job(threads=None, compile=False, device="cpu", tp=1):
        spec = SimpleNamespace(
            device=torch.device(device), compile=compile, tensor_parallel_size=tp
        )
        return SimpleNamespace(cfg=SimpleNamespace(threads=threads), spec=spec)

    assert isinstance(_thread_governor(job()), ThreadGovernor)
    for other in (job(compile=True), job(threads=2), job(device="cuda"), job(tp=2)):
        assert _thread_governor(other) is None
