"""Typed config: the post's YAML block loads as written; every bad key or value is named."""

from pathlib import Path

import pytest

from macroarch.config import ConfigError, DGRConfig, MacroConfig, MVASConfig, OptimConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
POST = {"optim": {"macro_architecture": True, "group_size": 6,
                  "precision_policy": {"text": "fp16", "image": ["fp8", "fp16"]}}}


def test_the_post_block_is_the_committed_yaml_and_loads_unchanged():
    config = load_config(ROOT / "configs" / "clip_post.yaml")
    assert config == load_config(POST)
    assert config.optim.macro_architecture and config.uses_mvas and config.uses_dgr
    # the shorthand under optim fills the component configs
    assert config.dgr.group_size == 6
    assert config.mvas.precision_policy == {"text": "fp16", "image": ("fp8", "fp16")}


@pytest.mark.parametrize("bad, named", [
    ({"optim": {"precison_policy": {}}}, "optim: unknown key 'precison_policy'"),
    ({"optimizer": {}}, "unknown key 'optimizer'"),
    ({"optim": {"group_size": 0}}, "optim.group_size"),
    ({"optim": {"group_size": "six"}}, "optim.group_size"),
    ({"optim": {"precision_policy": {"image": ["fp8", "fp16", "fp4"]}}}, "optim.precision_policy.image"),
    ({"optim": {"precision_policy": {"image": []}}}, "optim.precision_policy.image"),
    ({"optim": {"precision_policy": {"text": "fp9"}}}, "unknown format 'fp9'"),
    ({"optim": {"macro_architecture": "yes"}}, "optim.macro_architecture"),
    ({"mvas": {"block_size": 1.5}}, "mvas.block_size"),
    ({"mvas": {"shallow_fraction": 1.0}}, "mvas.shallow_fraction"),
    ({"mvas": {"precision_policy": {"text": "fp16"}, "target_reduction": 0.3}}, "not both"),
    ({"dgr": {"mode": "async"}}, "dgr.mode"),
    ({"optim": {"betas": [0.9]}}, "optim.betas"),
    ({"optim": {"macro_architecture": True, "group_size": 6}, "dgr": {"group_size": 4}}, "conflicts"),
    ([1, 2], "expected a mapping"),
])
def test_bad_keys_and_values_are_named(bad, named):
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("(", r"\(")):
        load_config(bad)


def test_macro_architecture_false_ignores_the_shorthand():
    config = load_config({"optim": {"macro_architecture": False, "group_size": 6,
                                    "precision_policy": {"text": "fp16"}}})
    assert not config.uses_mvas and not config.uses_dgr


def test_yaml_errors_name_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  group_size: [\n")
    with pytest.raises(ConfigError, match="c.yaml"):
        load_config(path)
    path.write_text("optim:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=r"c.yaml: optim"):
        load_config(path)


def test_every_field_has_a_docstring():
    import ast
    import inspect

    for cls in (MVASConfig, DGRConfig, OptimConfig, MacroConfig):
        body = ast.parse(inspect.getsource(cls)).body[0].body
        documented = {body[i].target.id for i in range(len(body) - 1)
                      if isinstance(body[i], ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)}
        fields = {f for f in cls.__dataclass_fields__}
        assert fields == documented, f"{cls.__name__}: fields without a docstring: {fields - documented}"


@pytest.mark.parametrize("key, value", [
    ("optim.lr", ".nan"), ("optim.lr", ".inf"), ("optim.eps", ".nan"), ("optim.weight_decay", "-.inf"),
    ("optim.betas", "[.nan, 0.999]"), ("mvas.target_reduction", ".nan"), ("mvas.shallow_fraction", ".nan"),
    ("dgr.max_grad_norm", ".nan"), ("dgr.max_grad_norm", ".inf"),
])
def test_non_finite_numbers_are_refused_at_load_naming_the_key(tmp_path, key, value):
    """YAML's .nan and .inf parse as floats; every numeric setting refuses them, in the file and in a mapping."""
    section, name = key.split(".")
    path = tmp_path / "c.yaml"
    path.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"c.yaml: {key}"):
        load_config(path)
    import yaml

    with pytest.raises(ConfigError, match=key):
        load_config(yaml.safe_load(path.read_text()))


def test_a_non_finite_lr_is_refused_by_the_dataclass_too():
    with pytest.raises(ConfigError, match="optim.lr"):
        OptimConfig(lr=float("nan"))
    with pytest.raises(ConfigError, match="dgr.max_grad_norm"):
        DGRConfig(max_grad_norm=float("inf"))
