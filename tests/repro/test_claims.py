import re
from pathlib import Path

import pytest

from macroarch.config import ConfigError
from macroarch.repro.claims import (
    CLAIMS,
    CONTRADICTED,
    GRADES,
    NOT_REPRODUCED,
    PARTIALLY,
    REPRODUCED,
    Target,
    Verdict,
    combine,
    get_claim,
    parse_claim_ids,
)

ROOT = Path(__file__).resolve().parents[2]
CLAIMS_MD = ROOT.parent / "shared" / "CLAIMS.md"


def test_registry_matches_claims_md():
    if not CLAIMS_MD.is_file():
        pytest.skip(f"{CLAIMS_MD} not present beside the checkout")
    text = CLAIMS_MD.read_text(encoding="utf-8")
    rows = re.findall(r"^\| (C\d+|R\d+) \| ([^|]+) \|", text, flags=re.M)
    assert rows, "no claim rows found in CLAIMS.md"
    assert [cid for cid, _ in rows] == list(CLAIMS)
    for cid, section in rows:
        assert CLAIMS[cid].section == section.strip(), cid


def test_every_claim_has_a_statement_targets_and_a_notebook_name():
    for claim in CLAIMS.values():
        assert claim.statement and claim.measures and claim.targets
        assert re.fullmatch(r"\d\d_[a-z0-9_]+", claim.notebook)
        assert len({t.metric for t in claim.targets}) == len(claim.targets), claim.id


def test_profiles_run_only_registered_notebooks_that_exist():
    import yaml

    registered = {c.notebook for c in CLAIMS.values()}
    for profile in ("ci", "cpu", "gpu"):
        entries = yaml.safe_load((ROOT / "papermill_runs" / f"{profile}.yaml").read_text())["notebooks"]
        for entry in entries:
            assert entry["notebook"] in registered, (profile, entry["notebook"])
            assert (ROOT / "notebooks" / f"{entry['notebook']}.ipynb").is_file()


@pytest.mark.parametrize("x, grade", [(0.30, REPRODUCED), (0.27, REPRODUCED), (0.15, PARTIALLY), (0.5, PARTIALLY),
                                      (0.01, NOT_REPRODUCED), (-0.2, CONTRADICTED)])
def test_range_target_grades(x, grade):
    t = Target("reduction", "range", lo=0.27, hi=0.35, rel_tol=0.0, null=0.0)
    assert t.grade(x) == grade


def test_at_least_target_with_null_one():
    t = Target("factor", "at_least", 8.0, rel_tol=0.1, null=1.0)
    assert t.grade(7.3) == REPRODUCED      # within 10% of 8
    assert t.grade(20.0) == REPRODUCED
    assert t.grade(2.0) == PARTIALLY       # lower variance, not 8x
    assert t.grade(1.05) == NOT_REPRODUCED  # under 10% of the claimed effect (7)
    assert t.grade(0.2) == CONTRADICTED     # variance went up 5x


def test_target_rejects_bad_definitions_and_measurements():
    with pytest.raises(ValueError, match="kind"):
        Target("m", "roughly", 1.0)
    with pytest.raises(ValueError, match="lo <= hi"):
        Target("m", "range", lo=2, hi=1)
    with pytest.raises(ValueError, match="finite"):
        Target("m", "value", 1.0).grade(float("nan"))


def test_combine():
    assert combine([REPRODUCED, REPRODUCED]) == REPRODUCED
    assert combine([REPRODUCED, NOT_REPRODUCED]) == PARTIALLY
    assert combine([CONTRADICTED, NOT_REPRODUCED]) == NOT_REPRODUCED
    assert combine([CONTRADICTED, CONTRADICTED]) == CONTRADICTED


def test_c4_rule():
    c4 = get_claim("C4")
    # The post's arithmetic: 175e9 params x 8 B; what mixed precision needs: x 16 B.
    v = c4.grade({"post_accounting_bytes": 175e9 * 8, "mixed_precision_bytes": 175e9 * 16}, scale="175B")
    assert v.grade == PARTIALLY and "master" in v.note
    v = c4.grade({"post_accounting_bytes": 175e9 * 8, "mixed_precision_bytes": 175e9 * 8}, scale="175B")
    assert v.grade == REPRODUCED
    v = c4.grade({"post_accounting_bytes": 175e9 * 4, "mixed_precision_bytes": 175e9 * 16}, scale="175B")
    assert v.grade == NOT_REPRODUCED
    v = c4.grade({"post_accounting_bytes": 1e9, "mixed_precision_bytes": 2e9}, scale="tiny")
    assert v.grade == CONTRADICTED


def test_grade_needs_every_target_metric_and_a_scale():
    with pytest.raises(KeyError, match="mixed_precision_bytes"):
        get_claim("C4").grade({"post_accounting_bytes": 1.4e12}, scale="175B")
    with pytest.raises(ValueError, match="scale"):
        Verdict(grade=REPRODUCED, measured="1", target="1", scale="")
    with pytest.raises(ValueError, match="unknown grade"):
        Verdict(grade="sort of", measured="1", target="1", scale="x")
    assert set(GRADES) >= {REPRODUCED, PARTIALLY}


def test_unknown_claim_ids_are_named():
    with pytest.raises(ConfigError, match="'C99'"):
        get_claim("C99")
    with pytest.raises(ConfigError, match="'C42'"):
        parse_claim_ids("C4,C42")
    assert parse_claim_ids("c4, r1") == ["C4", "R1"]


def test_c8_rule_asks_whether_four_is_where_the_master_copy_starts_to_matter():
    c8 = get_claim("C8")
    base = dict(master_copy_noise=0.001, scale_rule_vs_gradscaler=1.0)
    assert c8.grade(dict(base, master_copy_loss_gain=0.03, master_copy_loss_gain_below_4=0.001), scale="s").grade \
        == "reproduced"
    assert c8.grade(dict(base, master_copy_loss_gain=0.03, master_copy_loss_gain_below_4=0.03), scale="s").grade \
        == "partially"
    within_noise = c8.grade(dict(base, master_copy_loss_gain=0.001, master_copy_loss_gain_below_4=0.0), scale="s")
    assert within_noise.grade == "partially" and "master copy not reproduced" in within_noise.note  # scale rule holds
    assert "master copy contradicted" in c8.grade(dict(base, master_copy_loss_gain=-0.01,
                                                       master_copy_loss_gain_below_4=0.0), scale="s").note


def test_c10_rule_lets_the_seed_interval_decide_outside_the_range():
    c10 = get_claim("C10")
    assert c10.grade(dict(best_lr_multiplier=1.3), scale="s").grade == "reproduced"
    assert c10.grade(dict(best_lr_multiplier=0.6, best_lr_multiplier_lo=0.5, best_lr_multiplier_hi=2.0),
                     scale="s").grade == "not reproduced"
    assert c10.grade(dict(best_lr_multiplier=0.6, best_lr_multiplier_lo=0.5, best_lr_multiplier_hi=0.8),
                     scale="s").grade == "contradicted"
    assert c10.grade(dict(best_lr_multiplier=2.0, best_lr_multiplier_lo=1.6, best_lr_multiplier_hi=2.4),
                     scale="s").grade == "partially"
