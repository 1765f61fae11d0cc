"""The installed dependency set: inside pyproject.toml's ranges, and a transformers/peft pair that manages adapters.

A dependency release can turn a fresh install red with no change here (transformers 5.24 refused every released peft).
These tests say which pair broke, so that a bound in pyproject.toml is lifted on purpose, never by accident.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, requires, version
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def declared_requirements(extra: str = "dev") -> list[Requirement]:
    """trl-vapo's installed requirements (pyproject.toml's, as installed): the core ones and those of `extra`."""
    declared = [Requirement(line) for line in requires("trl-vapo")]
    return [r for r in declared if r.marker is None or r.marker.evaluate({"extra": extra})]


def test_installed_versions_are_inside_pyprojects_ranges():
    """What is installed is what pyproject.toml allows: otherwise the suite tests a set users never get."""
    outside = []
    for requirement in declared_requirements():
        try:
            installed = version(requirement.name)
        except PackageNotFoundError:
            outside.append(f"{requirement.name} is not installed (pyproject.toml asks for `{requirement}`)")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            outside.append(f"{requirement.name} {installed} is outside pyproject.toml's `{requirement.specifier}`")
    assert not outside, "; ".join(outside) + ". Reinstall: `python3 dev.py setup`."


def test_transformers_and_peft_manage_an_adapter(tiny_model_dir, tmp_path):
    """transformers' PEFT integration (what the model card's quick start and `pipeline` use) loads a LoRA adapter.

    transformers 5.24 raises `ValueError: The version of PEFT you are using is not compatible, please use a version
    >= 0.22.0` here with peft 0.21; pyproject.toml bounds transformers below 5.24 until such a peft exists.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    pair = f"transformers {version('transformers')} with peft {version('peft')}"
    adapter = get_peft_model(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"),
    )
    adapter.save_pretrained(tmp_path / "adapter")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    try:
        model.load_adapter(str(tmp_path / "adapter"), adapter_name="vapo")
        model.set_adapter("vapo")
    except (ValueError, ImportError) as error:
        pytest.fail(f"{pair} cannot load a LoRA adapter ({error}); keep this pair excluded in pyproject.toml")
    assert model.active_adapters() == ["vapo"], pair


def _dev_script():
    """`dev.py`, the README's setup script, imported as a module (it is a script at the repository's root)."""
    spec = importlib.util.spec_from_file_location("dev_script", ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_lock_pins_every_declared_dependency_inside_its_range():
    dev = _dev_script()
    pins = dev.read_lock()
    for requirement in declared_requirements():
        name = dev.canonical_name(requirement.name)
        assert name in pins, f"{dev.LOCK.name} does not pin {name}: re-run `python3 dev.py upgrade`"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{dev.LOCK.name} pins {name}=={pins[name]}, outside pyproject.toml's `{requirement.specifier}`"
        )
    assert dev.lock_python() != "unknown", "the lock must name the interpreter it was tested on"


def test_a_frozen_environment_round_trips_through_the_lock(tmp_path):
    """What `dev.py upgrade` writes from `pip freeze` reads back as the same pins: torch without its `+cpu` label."""
    dev = _dev_script()
    pins = dev.freeze(Path(sys.executable))
    assert pins["torch"] == version("torch").split("+")[0] and "trl-vapo" not in pins
    assert pins["pyyaml"] == version("PyYAML")  # names are normalised: pip prints `PyYAML`, pyproject says `pyyaml`
    path = tmp_path / "constraints.txt"
    dev.write_lock(pins, path)
    assert dev.read_lock(path) == pins and dev.lock_python(path) == dev.python_tag()
    assert dev.parse_pins("# comment\nfoo_bar==1.0+cu12  # why\n\nbaz @ file:///x\n") == {"foo-bar": "1.0"}


def test_a_venv_left_half_built_or_without_pip_is_not_taken_for_built(tmp_path):
    """A first run stopped while venv installed pip, or Ubuntu's Python without `python3-venv` (its venv writes the
    interpreter, then exits): `.venv/bin/python` existed, so every later run skipped creating it and failed at its
    first install ("No module named pip"), until the user deleted it. And a Python too old for the project (a Mac's
    own 3.9) built the venv first, then failed installing."""
    import venv

    dev = _dev_script()
    assert dev.venv_python_tag(Path(sys.prefix)) == dev.python_tag()  # the suite's own: whole
    venv.EnvBuilder(with_pip=False).create(tmp_path / "half")
    assert dev.python_of(tmp_path / "half").exists() and dev.venv_python_tag(tmp_path / "half") is None
    assert dev.venv_python_tag(tmp_path / "none") is None
    assert dev.python_problem((3, 9, 6)).startswith("dev.py needs Python 3.10 or newer; this is 3.9")
    assert dev.python_problem((3, 10, 0)) is None


def test_where_uv_cannot_install_pip_does_with_this_machines_pip_configuration(tmp_path, monkeypatch, capfd):
    """uv reads none of pip's configuration: on a machine whose pip installs from a mirror, a proxy or a wheel folder
    (`PIP_FIND_LINKS`, pip.conf), `dev.py`'s uv install failed and the README's first command stopped there. pip
    tries then. Real installers: the suite's uv, offline, and a new venv's pip, configured for a folder of wheels
    alone, with a package only that folder has."""
    import venv
    import zipfile

    dev = _dev_script()
    if not (dev.bin_dir(Path(sys.prefix)) / "uv").exists():
        pytest.skip("the suite's venv has no uv (dev.py installs it; a venv made otherwise may not)")
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    dist_info = "trl_vapo_probe-1.0.dist-info"
    with zipfile.ZipFile(wheels / "trl_vapo_probe-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("trl_vapo_probe.py", "FOUND = True\n")
        wheel.writestr(f"{dist_info}/METADATA", "Metadata-Version: 2.1\nName: trl-vapo-probe\nVersion: 1.0\n")
        wheel.writestr(
            f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{dist_info}/RECORD", "")
    env = tmp_path / "env"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env)
    # Its pip is the suite's (a path file: a venv's own pip takes ensurepip some seconds to install); it installs
    # into the new venv, whose interpreter runs it. Its uv too (else dev.py pip-installs one).
    site = subprocess.run(
        [str(dev.python_of(env)), "-c", "import site; print(site.getsitepackages()[0])"],
        capture_output=True,
        text=True,
    )
    (Path(site.stdout.strip()) / "suite_pip.pth").write_text(str(Path(pytest.__file__).parent.parent) + "\n")
    (dev.bin_dir(env) / "uv").symlink_to(dev.bin_dir(Path(sys.prefix)) / "uv")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("UV_OFFLINE", "1")  # (uv would look for it on PyPI)
    dev.install_packages(env, "trl-vapo-probe")
    out = capfd.readouterr()
    assert "uv could not install; pip, which reads this machine's pip configuration, tries" in out.out
    found = subprocess.run([str(dev.python_of(env)), "-c", "import trl_vapo_probe; print(trl_vapo_probe.__file__)"],
                           capture_output=True, text=True)  # fmt: skip
    assert found.returncode == 0 and found.stdout.startswith(str(env)), found.stderr


def test_the_demo_and_the_tests_run_in_dev_pys_place():
    """`dev.py demo` ran `trl-vapo train` under `subprocess.run`, which kills its child 0.25 s after a Ctrl-C: the
    demo's stop (the rollout finished, a checkpoint written) never happened under the README's first command, and a
    SIGTERM to dev.py left the run going. The command now takes dev.py's process: its PID."""
    load = f"import importlib.util as u; s = u.spec_from_file_location('d', {str(ROOT / 'dev.py')!r}); "
    load += "d = u.module_from_spec(s); s.loader.exec_module(d); "
    command = load + "d._exec(__import__('sys').executable, '-c', 'import os; print(os.getpid())')"
    process = subprocess.Popen([sys.executable, "-c", command], stdout=subprocess.PIPE, text=True)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 0 and stdout.split()[-1] == str(process.pid), stdout


def test_on_windows_the_demo_installs_without_deepspeed_and_starts_trl_vapo_by_its_exe(monkeypatch):
    """The README's first command on Windows (emulated: no Windows machine runs the suite): the dev extra pulled in
    DeepSpeed, which PyPI has no Windows wheel of after 0.16.5 and whose source build there needs an administrator's
    console, so the install failed; and Windows starts a program by its path only with `.exe` named
    (`CreateProcess`), which `.venv\\Scripts\\trl-vapo` lacked."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10, which the project supports: tomllib came with 3.11
        tomllib = pytest.importorskip("tomli")

    dev_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    dev_extra = [Requirement(line) for line in dev_extra]
    required = {
        platform: {r.name for r in dev_extra if r.marker is None or r.marker.evaluate({"sys_platform": platform})}
        for platform in ("linux", "darwin", "win32")
    }
    assert "deepspeed" in required["linux"] and "deepspeed" in required["darwin"]
    assert required["win32"] == required["linux"] - {"deepspeed"}
    dev = _dev_script()
    started = []
    monkeypatch.setattr(dev, "setup", lambda: None)
    monkeypatch.setattr(dev, "python_problem", lambda: None)
    monkeypatch.setattr(dev, "_exec", lambda *cmd: started.append(cmd) or 0)
    monkeypatch.setattr(dev.os, "name", "nt")
    assert dev.main(["demo", "--max_steps", "1"]) == 0
    program = started[0][0]
    assert program.name == "trl-vapo.exe" and program.parent.name == "Scripts", program
    assert started[0][1:] == ("train", "--max_steps", "1")


def test_on_windows_a_ctrl_c_reaches_the_demo_and_dev_py_waits_for_its_stop():
    """Windows has no exec: dev.py runs the demo as its child, and the console gives a Ctrl-C to both. Under
    `subprocess.run`, dev.py's KeyboardInterrupt killed the child 0.25 s later, before the stop's checkpoint. Emulated
    here (`os.name` set to Windows' in a dev.py process, the Ctrl-C sent to its process group as a console sends it):
    the child finishes its stop and dev.py returns its exit status."""
    load = f"import importlib.util as u, os, sys; s = u.spec_from_file_location('d', {str(ROOT / 'dev.py')!r}); "
    load += "d = u.module_from_spec(s); s.loader.exec_module(d); os.name = 'nt'; "
    child = (
        "import os, signal, sys, time; stop = []; signal.signal(signal.SIGINT, lambda *a: stop.append(1)); "
        "print('ready', os.getppid(), flush=True); any(stop or time.sleep(0.05) for _ in range(600)); time.sleep(1); "
        "print('stopped whole'); "  # (waits for the Ctrl-C in short sleeps: a handled signal does not end a sleep)
        "sys.exit(3)"
    )
    command = load + f"sys.exit(d._exec(sys.executable, '-c', {child!r}))"
    process = subprocess.Popen(
        [sys.executable, "-c", command], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    ready = process.stdout.readline() + process.stdout.readline()  # dev.py's "+ ..." line, then the child's
    assert f"ready {process.pid}" in ready  # a child of dev.py's process, which waits for it (no exec replaced it)
    os.killpg(process.pid, signal.SIGINT)
    stdout, _ = process.communicate(timeout=60)
    assert process.returncode == 3 and "stopped whole" in stdout, (process.returncode, stdout)


def test_upgrade_reports_each_moved_package():
    dev = _dev_script()
    old = {"peft": "0.21.2", "torch": "2.13.0", "six": "1.16"}
    new = {"peft": "0.22.0", "torch": "2.13.0", "uv": "0.13"}
    assert dev.moved_packages(old, new) == ["peft 0.21.2 -> 0.22.0", "six 1.16 -> (gone)", "uv (new) -> 0.13"]


# ---------------------------------------------------------------------------------------------------------------------
# The package's imports: TRL's internals behind one file, no cycle
# ---------------------------------------------------------------------------------------------------------------------


def package_imports() -> dict[str, list[tuple[str, list[str], bool]]]:
    """Per module of `trl_vapo` (dotted name): each import as (module, imported names, at module level)."""
    import ast

    found = {}
    for path in sorted((ROOT / "trl_vapo").rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text())
        top_level = {id(node) for node in tree.body}
        imports = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports += [(alias.name, [], id(node) in top_level) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this module's package
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                if node.module is None:  # `from . import checkpoint`: the names are modules
                    imports += [(f"{base}.{alias.name}", [], id(node) in top_level) for alias in node.names]
                else:
                    imports.append((base, [alias.name for alias in node.names], id(node) in top_level))
        found[name] = imports
    return found


def test_only_compat_imports_trl_names_outside_its_public_api():
    """A TRL upgrade that moves a private helper breaks `trl_vapo/_compat.py` alone: every other module imports from
    TRL only what `trl.__all__` exports (`from trl import X`)."""
    import trl

    public = set(trl.__all__)
    private = []
    for module, imports in package_imports().items():
        if module == "trl_vapo._compat":
            continue
        for target, names, _ in imports:
            if target == "trl":
                private += [f"{module}: from trl import {n}" for n in names if n not in public]
            elif target.startswith("trl."):
                private.append(f"{module}: {target}")
    assert not private, f"import these through trl_vapo/_compat.py: {private}"
    compat = {target for target, _, _ in package_imports()["trl_vapo._compat"]}
    assert {"trl.kernels", "trl.trainer.utils", "trl.generation.vllm_generation"} <= compat  # the check sees imports


def test_the_package_has_no_import_cycle_at_module_level():
    graph = {
        module: {target for target, _, top in imports if top and target.startswith("trl_vapo.") and target != module}
        for module, imports in package_imports().items()
    }
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(target) :] + [module, target]))
            if target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])
    assert graph["trl_vapo.generation"] >= {"trl_vapo._compat", "trl_vapo.vllm_sync"}  # the graph is read
    assert "trl_vapo.checkpoint" in graph["trl_vapo.trainer"]  # `from . import checkpoint as ckpt`


def test_sampling_and_scoring_import_nothing_of_training_even_inside_functions():
    """An engine samples, it does not train: `generation` takes its vLLM defaults from nowhere above it (the config
    and `trl-vapo eval` take them from `vllm_fields`, as the engine does). The reward models load with
    `pretrained.from_pretrained_kwargs`, which `modeling` uses too, so `scoring` does not reach into the actor-critic's
    module."""
    imports = package_imports()
    above = {"trl_vapo.config", "trl_vapo.trainer", "trl_vapo.cli", "trl_vapo.checkpoint"}
    assert not {target for target, _, _ in imports["trl_vapo.generation"]} & above
    assert "trl_vapo.vllm_fields" in {target for target, _, _ in imports["trl_vapo.generation"]}
    assert "trl_vapo.modeling" not in {target for target, _, _ in imports["trl_vapo.scoring"]}
    assert "trl_vapo.pretrained" in {target for target, _, _ in imports["trl_vapo.scoring"]}  # the check sees imports


def test_the_saving_code_reads_the_run_record_not_the_trainers_own_attributes():
    """`SavingMixin` (checkpoint.py) saves and loads; what it needs to know of the run comes from `run_record`
    (`model_card.RunRecord`, filled by the trainer) and its step counts from `run_plan` (`run.RunPlan`), not from the
    trainer's private attributes. transformers' `Trainer`, whose saving and loading it follows, is no private part of
    the trainer: its methods may be called (`_load_callback_state`)."""
    import ast

    from transformers import Trainer

    tree = ast.parse((ROOT / "trl_vapo" / "checkpoint.py").read_text())
    mixin = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SavingMixin")
    own = {n.name for n in mixin.body if isinstance(n, ast.FunctionDef)}
    own |= {n.target.id for n in mixin.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    attributes = [n for n in ast.walk(mixin) if isinstance(n, ast.Attribute)]
    own |= {a.attr for a in attributes if isinstance(a.ctx, ast.Store)}
    read = {a.attr for a in attributes if isinstance(a.value, ast.Name) and a.value.id == "self"}
    private = {name for name in read - own if name.startswith("_") and not name.startswith("__")}
    assert not private - set(dir(Trainer)), private
    assert {"run_record", "run_plan"} <= read


def test_every_extra_the_docs_and_messages_name_exists():
    """`pip install -e ".[x]"` in the README, an example, a help text or an error message names an extra
    pyproject.toml has; and none names the package as if it were on PyPI (`pip install trl-vapo`: not released)."""
    import re

    section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
    extras = set(re.findall(r"^([\w-]+) = \[", section, flags=re.MULTILINE))
    assert {"dev", "qlora"} <= extras
    texts = [ROOT / "README.md", *sorted((ROOT / "examples").rglob("*.*")), *sorted((ROOT / "trl_vapo").rglob("*.py"))]
    texts = [path for path in texts if path.suffix in (".md", ".py", ".yaml")]
    named = {(path.name, extra) for path in texts for extra in re.findall(r'"\.\[([\w,-]+)\]"', path.read_text())}
    assert named, 'no `".[...]"` found: the pattern is stale'
    assert not [path.name for path in texts if "pip install trl-vapo" in path.read_text()]
    assert not {(name, extra) for name, extra in named if not set(extra.split(",")) <= extras}, extras
