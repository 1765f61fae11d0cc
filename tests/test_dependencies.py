"""The installed dependency set: inside pyproject.toml's ranges, and a transformers/peft pair that manages adapters.

A dependency release can turn a fresh install red with no change here (transformers 5.24 refused every released peft).
These tests say which pair broke, so that a bound in pyproject.toml is lifted on purpose, never by accident.
"""

from __future__ import annotations

import importlib.util
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


def test_upgrade_reports_each_moved_package():
    dev = _dev_script()
    old = {"peft": "0.21.2", "torch": "2.13.0", "six": "1.16"}
    new = {"peft": "0.22.0", "torch": "2.13.0", "uv": "0.13"}
    assert dev.moved_packages(old, new) == ["peft 0.21.2 -> 0.22.0", "six 1.16 -> (gone)", "uv (new) -> 0.13"]
