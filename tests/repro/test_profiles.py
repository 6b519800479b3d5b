"""A profile means what it says (issue 47): every value it gives reaches the run or is refused before any kernel
starts. Each case below was accepted before and then dropped, run unbounded or failed inside a kernel."""

import json

import pytest

from conftest import PROFILE_ONLY, RECORDING
from conftest import write_notebook as _notebook
from conftest import write_profile as _profile
from macroarch.config import ConfigError, load_yaml
from macroarch.paths import project_root
from macroarch.repro import notebook as nbparams
from macroarch.repro import runner
from macroarch.repro.cli import main
from macroarch.repro.profiles import load_profile, parse_duration

RANGED = PROFILE_ONLY + ("size: int = None  # a size [1, 1000]\n"
                         "lr: float = 0.1  # a value with a default of its own\n"
                         "widths: list = None  # sizes of a sweep\n")


@pytest.fixture
def ranged(project):
    _notebook(project / "notebooks" / "02_memory_wall.ipynb", RECORDING, params=RANGED)
    return project


def _only(root, parameters, **entry):
    _profile(root, "ci", [{"notebook": "02_memory_wall", "parameters": {"widths": [4], **parameters}, **entry}])


# -- the shipped profiles --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("profile", ["ci", "cpu", "gpu"])
def test_every_shipped_profile_value_is_what_the_run_records(profile, monkeypatch):
    """gpu.yaml's ``device: cuda`` for notebook 09 resolved to cpu, ci.yaml's ``video_batch: 4`` for notebook 10 ran
    with 1, cpu.yaml's two stacks for notebook 08 ran three: each value given is now the effective one."""
    monkeypatch.delenv("MACROARCH_ROOT", raising=False)
    checked = 0
    for job in load_profile(profile, project_root()):
        effective = job.effective_parameters(profile)
        for name, value in job.parameters.items():
            assert effective[name] == (list(value) if isinstance(value, tuple) else value), (job.stem, name)
            checked += 1
    assert checked > 50
    if profile == "gpu":
        (nb09,) = [j for j in load_profile("gpu") if j.stem == "09_hardware_speedups"]
        assert nb09.effective_parameters("gpu")["device"] == "cuda"
    if profile == "ci":
        (nb10,) = [j for j in load_profile("ci") if j.stem == "10_applications"]
        assert nb10.effective_parameters("ci")["video_batch"] == 4


def test_a_value_for_a_parameter_with_a_default_is_refused_by_name(ranged):
    _only(ranged, {"size": 1, "lr": 0.5})
    with pytest.raises(ConfigError, match=r"parameter 'lr' has the default 0.1 in notebooks/02_memory_wall.ipynb, so "
                                          r"the profile's 0.5 would never reach the run"):
        load_profile("ci")


# -- ranges ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parameters, message", [
    ({"size": 0}, r"parameter 'size' must lie in \[1, 1000\], got 0 \(a size \[1, 1000\]\)"),
    ({"size": 10**12}, r"parameter 'size' must lie in \[1, 1000\], got 1000000000000"),
    ({"size": -3}, r"parameter 'size' must lie in \[1, 1000\], got -3"),
    ({"size": 2, "widths": [8, -8]}, r"parameter 'widths' must lie in \[0, \], got \[8, -8\]"),
])
def test_values_outside_their_range_are_refused_before_any_kernel(ranged, isolated, capsys, monkeypatch, parameters,
                                                                   message):
    _only(ranged, parameters)
    with pytest.raises(ConfigError, match=message):
        load_profile("ci")
    started = []
    monkeypatch.setattr(runner, "execute", lambda *a, **k: started.append(a))
    assert main(["reproduce", "--profile", "ci"]) == 2
    assert started == [] and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_kernel_side_checks_the_same_ranges(ranged):
    """A value typed into the parameters cell (or injected with papermill -p) meets the same range in the kernel."""
    _only(ranged, {"size": 5})
    assert nbparams.resolve("02_memory_wall", {"profile": "ci"})["size"] == 5
    with pytest.raises(ConfigError, match=r"02_memory_wall \(ci profile\): parameter 'size' must lie in \[1, 1000\]"):
        nbparams.resolve("02_memory_wall", {"profile": "ci", "size": 5000})


@pytest.mark.parametrize("line, message", [
    ("size: int = None  # a size [10, 1]\n", r"parameter 'size': its range '\[10, 1\]' is empty"),
    ("size: int = None  # a size [one, 2]\n", r"parameter 'size': its range '\[one, 2\]' is not \[low, high\]"),
])
def test_a_bad_declared_range_is_an_error_of_the_notebook(project, line, message):
    _notebook(project / "notebooks" / "02_memory_wall.ipynb", RECORDING, params=PROFILE_ONLY + line)
    with pytest.raises(ConfigError, match=message):
        load_profile("ci")


def test_every_shipped_integer_size_has_a_range():
    """Each notebook's integer parameters (but the seed) declare their range, so no size of 0 and no step count of
    10**12 reaches a kernel; every shipped value lies inside (load_profile above checks them)."""
    for path in sorted((project_root() / "notebooks").glob("*.ipynb")):
        spec = nbparams.notebook_parameters(path.stem, project_root())
        for p in spec.values():
            if p.type == "int" and p.name != "seed":
                assert p.high is not None, f"{path.name}: {p.name} has no [low, high] in its help text"


# -- budgets, timeouts, keys, paths, --only ----------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["0s", 0, "0m", -5, "25h", 10**6, "", "6 minutes"])
def test_budgets_of_zero_or_beyond_a_day_are_refused(value):
    with pytest.raises(ConfigError, match="budget must be a duration of more than 0 s and at most 24h"):
        parse_duration(value, "ci.yaml: x")
    assert parse_duration("24h", "x") == 86400


@pytest.mark.parametrize("timeout", [0, -1, 10**6, 1.5, True])
def test_timeouts_outside_a_day_are_refused(ranged, timeout):
    _only(ranged, {"size": 1}, timeout=timeout)
    with pytest.raises(ConfigError, match="timeout must be a whole number of seconds from 1 to 86400"):
        load_profile("ci")


@pytest.mark.parametrize("text, message", [
    ("notebooks:\n  - notebook: 02_memory_wall\n    parameters: {size: 1, size: 2, widths: [4]}\n",
     r"ci.yaml line 3: key 'size' is given twice \(first on line 3\)"),
    ("budget: 1m\nnotebooks:\n  - notebook: 02_memory_wall\n    parameters: {size: 1, widths: [4]}\nbudget: 2m\n",
     r"ci.yaml line 5: key 'budget' is given twice \(first on line 1\)"),
])
def test_a_key_given_twice_is_refused_with_its_lines(ranged, text, message):
    (ranged / "papermill_runs" / "ci.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_profile("ci")


def test_yaml_merge_keys_and_anchors_still_load(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("base: &b {size: 1, lr: 2}\nother:\n  <<: *b\n  size: 3\n")
    assert load_yaml(p) == {"base": {"size": 1, "lr": 2}, "other": {"size": 3, "lr": 2}}


@pytest.mark.parametrize("name", ["../README", "/etc/passwd", "sub/02_memory_wall", "..", "02_memory_wall/../x", 7])
def test_a_notebook_outside_notebooks_is_refused(ranged, name):
    (ranged / "README.ipynb").write_text(json.dumps({"cells": []}))
    _profile(ranged, "ci", [{"notebook": name}])
    with pytest.raises(ConfigError, match="must name a notebook in notebooks/ by its file name"):
        load_profile("ci")


@pytest.mark.parametrize("only", ["", " ", ","])
def test_an_empty_only_is_refused_not_read_as_everything(ranged, capsys, monkeypatch, only):
    _only(ranged, {"size": 1})
    started = []
    monkeypatch.setattr(runner, "execute", lambda *a, **k: started.append(a))
    assert main(["reproduce", "--profile", "ci", "--only", only]) == 2
    assert "--only is empty" in capsys.readouterr().err and started == []
