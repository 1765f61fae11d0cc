"""`benchmarks/gpu_suite.py --smoke`: the GPU suite's own code (the CUDA tests' selection and report, the trainer
benchmark's split and ratios, generation against its bandwidth bound) on tiny models on the CPU, so it cannot rot
between the rare runs on a GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_suite  # noqa: E402
from helpers import run_benchmark  # noqa: E402


def test_smoke_runs_every_kind_of_part_and_writes_each_figure(tmp_path):
    """The trainer and generation parts. The tests part's command runs in
    `test_a_tests_part_stopped_at_its_limit_keeps_the_outcomes_and_names_the_test_left_running` (on a stand-in file:
    here every CUDA test skips, after a pytest process spent 10 s importing them), what it selects in
    `test_every_test_file_with_cuda_tests_is_one_the_gpu_run_runs`."""
    parts = "trainer-lora,generation"
    stdout = run_benchmark("gpu_suite.py", "--smoke", "--parts", parts, "--out", str(tmp_path))
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert list(report["parts"]) == parts.split(",")
    assert all(part["status"] == "ok" for part in report["parts"].values())

    # The trainer benchmark: the step split and VAPO's ratios to GRPO, against the targets.
    trainer = report["parts"]["trainer-lora"]
    vapo, grpo = trainer["rows"]["smoke/vapo-lora"], trainer["rows"]["smoke/grpo-lora"]
    for row in (vapo, grpo):
        assert row["step_s"] > 0 and row["tokens_per_s"] > 0
        # The peak is read over the training alone (the reset before it: what loading held at its height is not in
        # it), and training grows the memory in use.
        assert 0 < row["peak_growth_gib"] < row["peak_gib"]
        assert row["generation"] > 0 and row["update"] > 0
        assert row["generation"] + row["scoring"] + row["update"] <= row["step_s"] * 1.05
    assert vapo["trainable"] > grpo["trainable"]  # the critic adapter and value head
    ratio = trainer["vapo_over_grpo"]["lora"]
    assert ratio == {
        "step": vapo["step_s"] / grpo["step_s"],
        "peak": vapo["peak_gib"] / grpo["peak_gib"],
        "engines": [vapo["engine"], grpo["engine"]],  # (the step's ratio compares them too)
    }
    assert trainer["targets_met"] == {
        "lora step <= 1.1x": ratio["step"] <= 1.1,
        "lora peak <= 1.15x": ratio["peak"] <= 1.15,
    }

    # VAPO runs its defaults: the static-cache engine on a CUDA GPU, generate() on the CPU; each row names its engine.
    assert vapo["engine"] == ("StaticCacheEngine" if torch.cuda.is_available() else "TransformersGenerate")
    assert grpo["engine"] == "generate()"
    # Each run's seconds by phase, the steps among them, all within the process's own time.
    for row in (vapo, grpo):
        phases = row["phases"]
        assert list(phases) == ["start", "model", "trainer", "train", "total", "process"]
        assert 0 < phases["start"] + phases["model"] + phases["trainer"] + phases["train"] <= phases["total"]
        assert phases["total"] <= phases["process"]

    # Generation: each engine's tokens/s, ms per decode step and share of the memory-bandwidth bound.
    generation = report["parts"]["generation"]
    bound = generation["batch"] * generation["copy_bandwidth_bytes_per_s"] / generation["weight_bytes"]
    assert generation["bound_tokens_per_s"] == bound > 0
    cache_bytes = generation["kv_cache_tokens_read_per_step"] * generation["kv_cache_bytes_per_token"]
    with_cache = (
        generation["batch"] * generation["copy_bandwidth_bytes_per_s"] / (generation["weight_bytes"] + cache_bytes)
    )
    assert generation["bound_with_kv_cache_tokens_per_s"] == with_cache and cache_bytes > 0
    assert list(generation["engines"]) == ["static-cache captured", "generate()", "static-cache eager"]
    for row in generation["engines"].values():
        assert 0 < row["tokens"] <= generation["batch"] * generation["new_tokens"]
        assert row["share_of_bound"] == row["tokens"] / row["seconds"] / bound
        assert row["share_of_bound"] < row["share_of_bound_with_kv_cache"]  # (the cache's reads lower the bound)
        assert row["ms_per_step"] == 1000 * row["seconds"] / row["decode_steps"] and row["decode_steps"] > 0

    # The plain-text tables: on stdout and in gpu_suite.txt.
    summary = stdout.split("== summary")[1]
    assert f"VAPO / GRPO, lora ({vapo['engine']} / {grpo['engine']}): step" in summary
    assert "static-cache eager" in summary
    assert "seconds of each run" in summary
    heading = summary.split("\n", 1)[0]  # each part that ran, with its own seconds
    for name, part in report["parts"].items():
        assert (f"{name} {part['seconds']:.0f} s" in heading) == ("seconds" in part)
    assert (tmp_path / "gpu_suite.txt").read_text().strip().endswith(summary.strip().split("\n", 1)[1].strip())


def test_the_wheel_sets_are_the_locked_versions_and_install_offline():
    """The wheels carried to the GPU machine are the versions CI tests (constraints.txt), bitsandbytes never travels
    with transformers (41 + 13 MiB and the tree exceed a call's 64 MiB), and the install line stays offline and leaves
    the machine's torch alone."""
    versions = gpu_suite.constraint_versions()
    for wheel_set in gpu_suite.WHEELS:
        for requirement in gpu_suite.wheel_requirements(wheel_set):
            name, version = requirement.split("==")
            assert versions[name] == version
    base, qlora = set(gpu_suite.WHEELS["base"]), set(gpu_suite.WHEELS["qlora"])
    assert {"transformers", "trl", "peft", "datasets", "math-verify"} <= base
    assert qlora == base - {"transformers"} | {"bitsandbytes"}
    assert "torch" not in base | qlora
    command = gpu_suite.download_command("trl==1.16.0", Path("/tmp/w"))
    assert command[command.index("--python-version") + 1] == "3.12" and "--no-deps" in command
    assert "manylinux_2_24_x86_64" in command and "manylinux2014_x86_64" in command  # bitsandbytes is 2_24 only
    install = gpu_suite.INSTALL.format(wheels=".whl")
    for flag in ("--no-index", "--no-deps", "--target", ".whl/*.whl"):
        assert flag in install


def test_what_a_call_carries_is_every_wheel_of_the_folder(tmp_path):
    """The install line installs, and the call carries, every wheel in the folder: the report counted only the set's
    own, so the two sets downloaded into one folder (as the module's instructions said) passed as fitting, at 57 MiB
    with a tree of 25, and the base call would have installed bitsandbytes too. Wheel files of the sizes that count
    stand in for the downloads (no network here)."""

    def wheel(name: str, mib: float) -> None:
        (tmp_path / f"{name}-1.0-py3-none-any.whl").write_bytes(b"\0" * int(mib * 2**20))

    for name in gpu_suite.WHEELS["base"]:
        wheel(name.replace("-", "_"), 1)
    report, fits = gpu_suite.carried_wheels("base", tmp_path, tree_mib=25)
    assert fits and "9 wheels, 9.00 MiB; with the working tree (25.00 MiB) 34.00 MiB of the 64 MiB" in report
    wheel("bitsandbytes", 2)  # another set's, small enough to fit: still not the base call's
    report, fits = gpu_suite.carried_wheels("base", tmp_path, tree_mib=25)
    assert not fits and "also holds wheels of no 'base' package, installed with it: bitsandbytes-1.0" in report
    assert gpu_suite.carried_wheels("base", tmp_path, tree_mib=25 + 30)[0].count("DOES NOT FIT") == 1
    (tmp_path / "bitsandbytes-1.0-py3-none-any.whl").unlink()
    (tmp_path / "trl-0.9-py3-none-any.whl").write_bytes(b"\0")  # an older download left beside: pip refuses both
    report, fits = gpu_suite.carried_wheels("base", tmp_path, tree_mib=25)
    assert not fits and "holds two versions of trl, which pip refuses to install together" in report


def test_a_tests_training_run_stops_within_the_gpu_suites_tests_part(tmp_path, monkeypatch):
    """The FSDP2 test's two runs may take 300 s each, the tests part 240 s: a hung run stopped the part whole, its
    report lost with every other test's. The suite caps each run (`SCRIPT_TIMEOUT`) well within the part."""
    import subprocess
    import time

    from _script_process import SCRIPT_TIMEOUT, run_code

    # What the tests part gives its pytest process (its command not run here: `run_command` records it).
    given = []
    monkeypatch.setattr(gpu_suite, "run_command", lambda command, stop_at, env=None: given.append(env) or (0, False))
    gpu_suite.run_tests(tmp_path)
    assert (
        gpu_suite.SCRIPT_TIMEOUT == SCRIPT_TIMEOUT and 0 < float(given[0][SCRIPT_TIMEOUT]) <= gpu_suite.TESTS_LIMIT / 2
    )
    # ... and a run started there stops at it.
    monkeypatch.setenv(SCRIPT_TIMEOUT, "1")
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_code("import time; time.sleep(60)", cwd=tmp_path, timeout=300)
    assert time.monotonic() - began < 30


def test_a_part_still_running_at_the_limit_is_stopped_with_every_process_it_started(tmp_path):
    """`run_command` stops the command's whole process group at `stop_at` (a part's workers, pytest's, torchrun's:
    a grandchild here) and says it cut it; a command that ends in time gives its own exit code, also one a SIGKILL
    from elsewhere gives (the OOM killer's), which is no cut."""
    import time

    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    began = time.time()
    exit_code, cut = gpu_suite.run_command(["bash", "-c", script], stop_at=began + 1.5)
    assert cut and exit_code != 0
    assert time.time() - began < 12  # SIGTERM ended it; no wait for SIGKILL's grace
    grandchild = int(pid_file.read_text())
    status = Path(f"/proc/{grandchild}/stat")
    waited = time.time() + 5  # a SIGKILLed process leaves when the kernel gets to it: a loaded machine is slower
    while status.exists() and status.read_text().split()[2] != "Z" and time.time() < waited:
        time.sleep(0.05)
    assert not status.exists() or status.read_text().split()[2] == "Z"  # gone (or a zombie awaiting init)
    assert gpu_suite.run_command(["bash", "-c", "exit 3"], stop_at=time.time() + 30) == (3, False)
    # Its Python processes write unbuffered: one stopped so would lose what it held for the call's log.
    unbuffered = 'test "$PYTHONUNBUFFERED" = 1'
    assert gpu_suite.run_command(
        ["bash", "-c", unbuffered], stop_at=time.time() + 30, env={"PATH": "/usr/bin:/bin"}
    ) == (0, False)
    assert gpu_suite.run_command(["bash", "-c", "kill -9 $$"], stop_at=time.time() + 30) == (-9, False)


def test_a_part_cut_at_the_limit_is_reported_with_what_it_finished(tmp_path):
    """A part stopped at `--limit` is 'cut' in the table with the runs it finished, a failed tests part names its
    failing tests, and no part starts past the limit."""
    row = {
        "engine": "generate()", "step_s": 2.0, "generation": 1.0, "scoring": 0.1, "update": 0.5, "tokens_per_s": 8.0,
        "peak_gib": 0.1, "phases": {"start": 1.0}, "device": "cpu",
    }  # fmt: skip
    cut = {
        "ok": False,
        "exit_code": -15,
        "cut": True,
        "rows": {"smoke/vapo-lora": row},
        "status": "cut",
        "seconds": 9.4,
    }
    text = gpu_suite.format_part("trainer-lora", cut)
    assert text.startswith("trainer-lora: CUT at --limit after 9 s; what it finished:\n")
    assert "smoke/vapo-lora" in text and "2.00" in text and "VAPO / GRPO" not in text
    failed = {"ok": False, "exit_code": 1, "rows": {}, "status": "failed", "seconds": 3.0}
    assert gpu_suite.format_part("trainer-lora", failed) == "trainer-lora: FAILED (exit 1; its output is above)"
    # One run failed (bench_gpu.py went on with the others): its row says so, the others are whole.
    one_failed = {"ok": False, "exit_code": 1, "status": "failed", "seconds": 20.0}
    one_failed["rows"] = {
        "smoke/vapo-lora": {"error": "worker smoke/vapo-lora failed (exit 1)"},
        "smoke/grpo-lora": row,
    }
    text = gpu_suite.format_part("trainer-lora", one_failed)
    assert "smoke/vapo-lora         FAILED: worker smoke/vapo-lora failed (exit 1)" in text
    assert "smoke/grpo-lora" in text and "(bench_gpu.py; cpu)" in text and "  smoke/grpo-lora: start 1.0 s" in text
    tests = {"ok": False, "exit_code": 1, "cut": False, "status": "failed", "seconds": 80.0, "qlora": "run"}
    tests |= {"counts": {"passed": 1, "failure": 1}, "outcomes": {"a::ok": "passed", "b::bad": "failure"}}
    text = gpu_suite.format_part("tests", tests)  # the failing tests named where the call's output tail may not reach
    assert text.startswith("tests: FAILED (exit 1; its output is above); what it finished:\n") and "b::bad" in text

    import time

    began = time.time()  # the smoke trainer part, given 1 s, is cut before either run ends
    trainer = gpu_suite.run_trainer("smoke", ("vapo-lora", "grpo-lora"), True, tmp_path, stop_at=began + 1)
    assert trainer["ok"] is False and trainer["cut"] is True and trainer["rows"] == {}
    assert trainer["vapo_over_grpo"] == {} and trainer["targets_met"] == {}
    assert time.time() - began < 12

    stdout = run_benchmark(
        "gpu_suite.py", "--smoke", "--parts", "tests,generation", "--limit", "0", "--out", str(tmp_path)
    )
    report = json.loads((tmp_path / "gpu_suite.json").read_text())
    for part in ("tests", "generation"):  # past the limit: not started
        assert report["parts"][part]["status"] == "skipped" and report["parts"][part]["why"].startswith("limit: ")
    assert "tests: not run (limit: " in stdout


def test_a_part_is_not_started_where_the_limit_leaves_less_than_its_measured_time(tmp_path, monkeypatch):
    """The H200's second call (2026-11-27) started trainer-1.5B 153 s into its 375 s, about 220 s before its end: it
    was cut in its GRPO run, its VAPO row kept in the log alone. A part whose last measured time (`PART_SECONDS`) the
    limit does not leave is not started (a later call's `--parts` runs it). Here in this process, with a time set for
    the smoke part (none is known at tiny shapes), so that nothing runs."""
    import signal
    import time

    assert set(gpu_suite.PART_SECONDS) == set(gpu_suite.PARTS)
    monkeypatch.setattr(gpu_suite, "STARTED", time.time())
    monkeypatch.setattr(gpu_suite, "SMOKE_PART_SECONDS", {"trainer-full": 10_000})
    handler = signal.getsignal(signal.SIGTERM)  # (main sets its own)
    try:
        assert gpu_suite.main(["--smoke", "--parts", "trainer-full", "--limit", "600", "--out", str(tmp_path)]) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
    part = json.loads((tmp_path / "gpu_suite.json").read_text())["parts"]["trainer-full"]
    assert part["status"] == "skipped" and part["why"].startswith("limit: 10000 s expected (PART_SECONDS), 6")


def test_a_trainer_part_with_a_failed_run_keeps_the_pairs_that_ran(tmp_path, monkeypatch):
    """`bench_gpu.py` exits 1 after a run failed, its JSON holding every row (a failed one as `{"error": ...}`): the
    part is failed, and the ratios are those of the pairs both of whose runs were measured. The command is a stand-in
    that writes what bench_gpu.py writes (tests/test_bench_gpu.py runs the driver's failure for real)."""
    row = {"step_s": 2.0, "peak_gib": 1.0, "engine": "generate()"}
    rows = {
        "smoke/vapo-lora": {"step_s": 1.0, "peak_gib": 1.1, "engine": "StaticCacheEngine"},
        "smoke/vapo-full": {"error": "worker smoke/vapo-full failed (exit 1)"},
        "smoke/grpo-lora": row,
        "smoke/grpo-full": row,
    }

    def bench_gpu(command, stop_at, env=None):
        Path(command[command.index("--json") + 1]).write_text(json.dumps(rows))
        return 1, False

    monkeypatch.setattr(gpu_suite, "run_command", bench_gpu)
    methods = ("vapo-lora", "vapo-full", "grpo-lora", "grpo-full")
    result = gpu_suite.run_trainer("smoke", methods, True, tmp_path)
    assert result["ok"] is False and result["exit_code"] == 1 and result["rows"] == rows
    assert result["vapo_over_grpo"] == {
        "lora": {"step": 0.5, "peak": 1.1, "engines": ["StaticCacheEngine", "generate()"]}
    }
    assert result["targets_met"] == {"lora step <= 1.1x": True, "lora peak <= 1.15x": True}


def test_a_tests_part_stopped_at_its_limit_keeps_the_outcomes_and_names_the_test_left_running(tmp_path, monkeypatch):
    """pytest writes its JUnit report at the end: stopped at the tests part's own limit (a hang here: a test that
    sleeps), it writes none. The part still has each ended test's outcome, as the plugin streamed them (from xdist's
    controller: two workers, as on the GPU), names the test it interrupted, and failed; what a test recorded with
    `record_property` (the graph pool's bytes) comes back too."""
    (tmp_path / "test_standin.py").write_text(
        "import time\nimport pytest\n\n"
        "@pytest.mark.cuda\ndef test_passes(record_property):\n    record_property('engine_bytes', 1234)\n\n"
        "@pytest.mark.cuda\ndef test_fails():\n    assert False\n\n"
        "@pytest.mark.cuda\n@pytest.mark.skip(reason='no GPU')\ndef test_skips():\n    pass\n\n"
        "@pytest.fixture\ndef broken():\n    raise RuntimeError('setup')\n\n"
        "@pytest.mark.cuda\ndef test_errors(broken):\n    pass\n\n"
        "@pytest.mark.cuda\ndef test_hangs():\n    time.sleep(120)\n"
    )
    monkeypatch.setattr(gpu_suite, "CUDA_TEST_FILES", [str(tmp_path / "test_standin.py")])
    # The other four end within 2 s of the start alone; under the other test worker's load, 5 s was close.
    monkeypatch.setattr(gpu_suite, "TESTS_LIMIT", 8)
    out = tmp_path / "out"
    out.mkdir()
    result = gpu_suite.run_tests(out, smoke=False)
    # Its own limit (a hang), not the call's: a failure, which makes the suite's exit status 1.
    assert result["cut"] is False and result["ok"] is False and not (out / "cuda-tests.xml").exists()
    assert result["error"] == "stopped at TESTS_LIMIT (8 s) with 1 test(s) still running"
    assert result["outcomes"] == {
        "test_standin::test_passes": "passed",
        "test_standin::test_fails": "failure",
        "test_standin::test_skips": "skipped",
        "test_standin::test_errors": "error",
        "test_standin::test_hangs": "running",
    }
    assert result["counts"] == {"passed": 1, "failure": 1, "error": 1, "skipped": 1, "running": 1}
    assert result["properties"] == {"test_standin::test_passes::engine_bytes": "1234"}  # as JUnit gives it: text
    lines = [json.loads(line) for line in (out / "cuda-tests.jsonl").read_text().splitlines()]
    starts = [line["test"] for line in lines if line["when"] == "start"]
    assert len(starts) == len(set(starts)) == 5  # the controller alone writes, not each worker besides
    text = gpu_suite.format_part("tests", result | {"status": "failed", "seconds": 5.0})
    assert text.startswith("tests: FAILED (stopped at TESTS_LIMIT (8 s) with 1 test(s) still running); what it fin")
    assert "running  test_standin::test_hangs" in text and "failure  test_standin::test_fails" in text


def test_every_test_file_with_cuda_tests_is_one_the_gpu_run_runs():
    """`gpu_suite.py` runs `pytest -m cuda` on `CUDA_TEST_FILES` alone: a file whose CUDA tests are not listed would
    never run them on a GPU (tests marked `cuda`, or taking the `device` fixture, whose CUDA case is marked)."""
    import ast

    def has_cuda_tests(tree: ast.AST) -> bool:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
                if any(arg.arg == "device" for arg in node.args.args):
                    return True
            if isinstance(node, ast.Attribute) and node.attr == "cuda" and getattr(node.value, "attr", None) == "mark":
                return True
        return False

    root = Path(__file__).parent
    with_cuda = sorted(f"tests/{p.name}" for p in root.glob("test_*.py") if has_cuda_tests(ast.parse(p.read_text())))
    assert "tests/test_static_cache_engine.py" in with_cuda and "tests/test_logprobs.py" in with_cuda  # both kinds
    assert with_cuda == sorted(gpu_suite.CUDA_TEST_FILES)
    # What the issues ask the GPU run to show is among them.
    names = " ".join(
        node.name
        for path in gpu_suite.CUDA_TEST_FILES
        for node in ast.walk(ast.parse((ROOT / path).read_text()))
        if isinstance(node, ast.FunctionDef) and has_cuda_tests(node)
    )
    # A test that takes `device` runs its CPU case in the default suite: marked `cuda` besides, that case would leave
    # it (`-m cuda` selects the CUDA case alone, through the fixture's mark).
    both = [
        node.name
        for path in gpu_suite.CUDA_TEST_FILES
        for node in ast.walk(ast.parse((ROOT / path).read_text()))
        if isinstance(node, ast.FunctionDef)
        and any(arg.arg == "device" for arg in node.args.args)
        and any("cuda" in ast.unparse(decorator) for decorator in node.decorator_list)
    ]
    assert not both, both
    kinds = ["bf16", "gradient_checkpointing", "logprobs", "continuous_batching", "fsdp2_on_one_gpu", "qlora"]
    kinds += [
        "greedy_completions_and_logprobs_equal_generate",
        "captured_step_equals_the_eager_step",
        "weight_updates",
    ]
    for kind in kinds:
        assert kind in names, kind
