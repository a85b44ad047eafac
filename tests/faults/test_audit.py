"""The prompt and sample audits themselves (harness.audit / audit_samples), on hand-written ledgers: a carried
rest trained after a resume is exactly-once, a group generated again after a resume is "twice", a partial group
whose rest never trained is "lost", and a rolled-back step does not count."""

from __future__ import annotations

import json

import pytest

from .harness import SCORE, audit, audit_samples

RUN1 = {"run": "a", "resumed_from": 0}
RUN2 = {"run": "b", "resumed_from": 2}


def write(tmp_path, trained, dropped=()):
    (tmp_path / "trained_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trained))
    (tmp_path / "dropped_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dropped))


def step(run, n, *samples):
    return run | {"step": n, "prompts": sorted({s[0] for s in samples}), "samples": [list(s) for s in samples]}


@pytest.fixture(autouse=True)
def keep_score():
    before = dict(SCORE)
    yield
    SCORE.update({k: before[k] for k in ("lost", "twice")})  # these ledgers are wrong on purpose


def test_a_carried_rest_trained_after_the_resume_is_exactly_once(tmp_path):
    write(tmp_path, [step(RUN1, 1, (0, "r0/0", 2, False), (0, "r1/0", 2, False)),
                     step(RUN1, 2, (1, "r2/0", 2, False)),
                     step(RUN1, 3, (1, "r3/0", 2, False)),  # rolled back: run b resumed from step 2
                     step(RUN2, 3, (1, "r3/0", 2, True))])
    assert audit(tmp_path, 2)["twice"] == [] and audit(tmp_path, 2)["lost"] == []
    assert audit_samples(tmp_path, 2) == {"trained": 4, "twice": [], "lost": [], "carried": 1}


def test_a_group_generated_again_after_the_resume_is_twice(tmp_path):
    write(tmp_path, [step(RUN1, 2, (1, "r2/0", 2, False)),
                     step(RUN2, 3, (1, "x0/0", 2, False), (1, "x1/0", 2, False))])
    assert audit(tmp_path, 2)["twice"] == [1]
    assert audit_samples(tmp_path, 2)["twice"] == ["prompt 1: 3 samples of a group of 2"]


def test_a_partial_group_whose_rest_never_trained_is_lost_unless_dropped(tmp_path):
    write(tmp_path, [step(RUN1, 1, (0, "r0/0", 2, False)), step(RUN2, 3, (1, "r5/0", 1, False))])
    assert audit(tmp_path, 2)["lost"] == [] and audit_samples(tmp_path, 2)["lost"] == [0]
    write(tmp_path, [step(RUN1, 1, (0, "r0/0", 2, False)), step(RUN2, 3, (1, "r5/0", 1, False))],
          dropped=[RUN2 | {"step": 3, "prompts": [[0, "stale"]]}])
    assert audit_samples(tmp_path, 2)["lost"] == []
