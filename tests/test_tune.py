"""``polyamp.tune``'s framework-free search (``polyamp/tune/search.py``) on a model whose step is a sleep of
known length and whose loss is a known number: the knob that is faster is chosen, the one that breaks
parity, raises, returns NaN or is far slower is reported with its reason, a spent budget leaves the rest
listed as not tried, and the report's JSON and text carry all of it."""

import json
import math
import time
from pathlib import Path

import pytest

from polyamp import PolyampError
from polyamp.tune import Candidate, Knob
from polyamp.tune import search as search_module
from polyamp.tune.report import STATUSES, TuneReport
from polyamp.tune.search import tune as search
from polyamp.tune.space import check_policies

MS = 1e-3


class Sleeper:
    """A step that sleeps ``cost(candidate)`` seconds and returns ``loss(candidate, i)``."""

    framework = "none"
    name = "sleeper"

    def __init__(self, knobs, cost, loss=lambda c, i: 1.0 / (i + 1)):
        self.knobs, self.cost, self.loss = knobs, cost, loss
        self.built: list[Candidate] = []
        self.open = 0

    def build(self, candidate):
        self.built.append(candidate)
        self.open += 1
        tunable = self

        class Step:
            def step(self, i):
                time.sleep(tunable.cost(candidate))
                return tunable.loss(candidate, i)

            def close(self):
                tunable.open -= 1

        return Step()


def run(tunable, **kw):
    kw.setdefault("budget_s", 20.0)
    kw.setdefault("parity_steps", 3)
    return search(tunable, **kw)


def test_the_faster_value_is_chosen_and_the_slower_kept_out():
    knobs = {"fast": Knob((False, True), "fast path {value}"), "slow": Knob((False, True), "slow {value}")}

    def cost(c):
        return (5 * MS if c.get("fast") else 25 * MS) + (20 * MS if c.get("slow") else 0)

    t = Sleeper(knobs, cost)
    report = run(t, policies=("bf16-mixed",))
    by_label = {tr.candidate.label: tr for tr in report.trials}
    assert by_label["float32 fast=on slow=off"].status == "chosen"
    assert by_label["float32 fast=on slow=on"].status == "slower"
    assert by_label["bf16-mixed fast=on slow=off"].status == "chosen"
    assert report.tuned["float32"] == Candidate.of("float32", {"fast": True, "slow": False})
    assert report.best.get("fast") is True and report.best.get("slow") is False
    chosen = [tr for tr in report.trials if tr.status == "chosen"]
    assert all(tr.speedup > 2 and tr.ci95[0] > 1 for tr in chosen)  # 5x in sleeps
    assert any("fast=on: fast path on; measured" in r for r in report.reasons())
    assert t.open == 0  # every built step closed
    final = {f.key: f for f in report.final}
    assert set(final) == {"float32 default", "float32 tuned", "bf16-mixed default", "bf16-mixed tuned"}
    assert final["float32 tuned"].speedup > 2
    ratio, (lo, hi) = report.speedup("bf16-mixed")
    assert lo <= ratio <= hi and 0.5 < ratio < 2  # the same cost: about 1x


def test_a_knob_that_pays_only_with_a_later_choice_is_tried_again_in_a_second_pass():
    """``compile`` alone gains nothing; the ``kernel`` knob (tried after it) gains alone and makes compile
    pay (torch.compile around flash attention vs around the math kernel). One pass would stop at
    kernel=math; the second pass tries compile again on top of it and takes it, and tries nothing twice."""
    knobs = {"compile": Knob((False, True), "compile {value}"), "kernel": Knob(("flash", "math"), "{value}")}

    def cost(c):
        if c.get("kernel") == "math":
            return 8 * MS if c.get("compile") else 20 * MS
        return 30 * MS

    t = Sleeper(knobs, cost)
    report = run(t, policies=("float32",))
    assert [tr.candidate.label for tr in report.trials] == ["float32 compile=on kernel=flash",
                                                            "float32 compile=off kernel=math",
                                                            "float32 compile=on kernel=math"]
    # the same cost: slower or no gain by noise; no third pass: every neighbour was tried already
    assert [tr.status for tr in report.trials][0] in ("slower", "no gain")
    assert [tr.status for tr in report.trials][1:] == ["chosen", "chosen"]
    assert report.tuned["float32"] == Candidate.of("float32", {"compile": True, "kernel": "math"})
    assert sum("measured" in r for r in report.reasons()) == 2 and t.open == 0


def test_parity_failures_and_non_finite_losses_are_reported_with_their_reason():
    knobs = {"mode": Knob(("a", "off-by-10%", "nan", "raises"), "mode {value}")}

    def loss(c, i):
        mode = c.get("mode")
        if mode == "raises":
            raise RuntimeError("unsupported op")
        if mode == "nan" and i == 1:
            return math.nan
        return (1.1 if mode == "off-by-10%" else 1.0) / (i + 1)

    report = run(Sleeper(knobs, lambda c: MS, loss), policies=("float32",))
    status = {tr.candidate.get("mode"): tr for tr in report.trials}
    assert status["off-by-10%"].status == "parity" and "10.00% apart" in status["off-by-10%"].reason
    assert status["nan"].status == "failed" and "non-finite" in status["nan"].reason
    assert status["raises"].status == "failed" and "RuntimeError: unsupported op" in status["raises"].reason
    assert report.best == Candidate.of("float32", {"mode": "a"})
    assert all(tr.status in STATUSES for tr in report.trials)


def test_a_far_slower_configuration_is_not_timed_further(monkeypatch):
    monkeypatch.setattr(search_module, "SLOW_S", 0.05)
    knobs = {"k": Knob((0, 1), "k {value}")}
    report = run(Sleeper(knobs, lambda c: 0.2 if c.get("k") else 2 * MS), policies=("float32",))
    (trial,) = report.trials
    assert trial.status == "slower" and "not timed further" in trial.reason


def test_a_policy_that_breaks_parity_is_dropped_with_its_knobs():
    knobs = {"k": Knob((0, 1), "k {value}")}
    t = Sleeper(knobs, lambda c: MS, lambda c, i: 2.0 if c.policy == "fp16-mixed" else 1.0)
    report = run(t, policies=("fp16-mixed",))
    fp16 = [tr for tr in report.trials if tr.candidate.policy == "fp16-mixed"]
    assert [tr.status for tr in fp16] == ["parity"]
    assert "fp16-mixed" not in report.tuned and report.best.policy == "float32"


def test_a_spent_budget_lists_what_was_not_tried_and_the_budget_holds():
    knobs = {name: Knob((0, 1), f"{name} {{value}}") for name in "abcdef"}
    report = run(Sleeper(knobs, lambda c: 20 * MS), policies=("float32",), budget_s=0.8)
    statuses = [tr.status for tr in report.trials]
    assert "not tried" in statuses and len(statuses) == 6 and statuses[0] != "not tried"
    assert all("the budget did not allow it" in tr.reason and "a budget of about" in tr.reason
               for tr in report.trials if tr.status == "not tried")  # fmt: skip
    assert all(tr.rounds >= 3 for tr in report.trials if tr.status != "not tried")  # never a 1-round try
    assert report.spent_s < 0.8 * 1.1 and not report.notes  # within the budget, and a knob was tried


def test_a_budget_too_small_for_one_paired_round_says_so_and_what_budget_would_do():
    """Regression: a budget the float32 reference nearly spent tried nothing ("the budget was spent"),
    ran its final rounds past the budget and reported a zero-width interval from one round."""
    knobs = {name: Knob((0, 1), f"{name} {{value}}") for name in "ab"}
    small = run(Sleeper(knobs, lambda c: 30 * MS), policies=("bf16-mixed",), budget_s=0.45)
    assert {tr.status for tr in small.trials if tr.baseline is not None} == {"not tried"}
    assert [tr.status for tr in small.trials if tr.baseline is None] == ["ok"]  # the default: always checked
    (note,) = small.notes
    assert "too small for even one paired round" in note and "would try the first knob value" in note
    assert small.spent_s < 0.45 * 1.1  # the reference, the default's check, 3 final rounds (30 ms steps)
    assert [f.rounds for f in small.final] == [0, 3]  # float32's default, and bf16's paired with it
    assert all(f.ci95 is None or f.ci95[0] < f.ci95[1] for f in small.final)  # no zero-width interval
    assert "budget:" in small.text() and note in small.text()
    first = float(note.split("a budget of about ")[1].split(" s")[0])
    enough = run(Sleeper(knobs, lambda c: 30 * MS), policies=("bf16-mixed",), budget_s=first * 1.3)
    assert any(tr.status not in ("ok", "not tried") for tr in enough.trials)  # what it said would do


def test_one_round_gives_no_interval_and_the_text_says_n_a():
    """Regression: one paired round's bootstrap "interval" was the sample itself ([1.945, 1.945])."""
    from polyamp.tune.report import Final, TuneReport

    f32, bf16 = Candidate.of("float32", {}), Candidate.of("bf16-mixed", {})
    final = [Final("float32 default", f32, 0.2, None, None, None, [0.2]),
             Final("bf16-mixed default", bf16, 0.1, 2.0, None, None, [0.1], 1)]  # fmt: skip
    report = TuneReport("none", "m", ("float32", "bf16-mixed"), {}, [], {"float32": f32, "bf16-mixed": bf16},
                        final, 1.0, 1.0, 3, 0.05, 0.03, 1.0)  # fmt: skip
    assert report.speedup("bf16-mixed") == (2.0, None)
    assert report.to_json()["speedup_over_tuned_float32"]["bf16-mixed"] == {"speedup": 2.0, "ci95": None,
                                                                            "rounds": 1}  # fmt: skip
    assert "tuned bf16-mixed / tuned float32: 2.00x (95 % interval n/a (1 round))" in report.text()


def test_a_saved_report_loads_back_equal(tmp_path):
    knobs = {"k": Knob((0, 1), "k {value}"), "only": Knob(("a", "b"), "{value}", policies=("bf16-mixed",))}
    report = run(Sleeper(knobs, lambda c: (1 if c.get("k") else 4) * MS), policies=("bf16",))
    report.save(tmp_path / "tune.json")
    loaded = TuneReport.load(tmp_path / "tune.json")
    assert loaded == report and loaded.best == report.best and loaded.settings == report.settings
    assert loaded.knobs["only"].policies == ("bf16-mixed",) and loaded.text() == report.text()
    (tmp_path / "bad.json").write_text('{"framework": "torch"}')
    with pytest.raises(PolyampError, match="not a polyamp tune report: missing name"):
        TuneReport.load(tmp_path / "bad.json")
    with pytest.raises(PolyampError, match="cannot read the tune report"):
        TuneReport.load(tmp_path / "none.json")


def test_the_report_goes_to_json_and_text(tmp_path):
    knobs = {"k": Knob((0, 1), "k {value}")}
    report = run(Sleeper(knobs, lambda c: (1 if c.get("k") else 4) * MS), policies=("bf16",))
    path = tmp_path / "tune.json"
    report.save(path)
    data = json.loads(path.read_text())
    assert data["best"] == report.best.to_json() and data["policies"] == ["float32", "bf16-mixed"]
    assert {t["status"] for t in data["trials"]} <= set(STATUSES)
    assert data["speedup_over_tuned_float32"]["bf16-mixed"]["speedup"] > 0
    text = report.text()
    assert "tuned bf16-mixed / tuned float32" in text and "best: " in text and "why:" in text


def test_bad_arguments_are_one_clear_error():
    knobs = {"k": Knob((0, 1), "k {value}")}
    t = Sleeper(knobs, lambda c: MS)
    with pytest.raises(PolyampError, match="tune compares float32, bf16-mixed, fp16-mixed"):
        check_policies(["mxfp8"])
    with pytest.raises(PolyampError, match="received 'bf16-true'"):
        check_policies("bf16-true")
    with pytest.raises(PolyampError, match="unknown precision policy 'fp7'"):
        check_policies("fp7")
    with pytest.raises(PolyampError, match=r"budget \(seconds\) must be a finite number > 0; received -1"):
        run(t, budget_s=-1)
    with pytest.raises(PolyampError, match="parity_steps must be an integer >= 2; received 1"):
        run(t, parity_steps=1)
    with pytest.raises(PolyampError, match="rtol must be a finite number > 0"):
        run(t, rtol=math.inf)
    nan = Sleeper(knobs, lambda c: MS, lambda c, i: math.nan)
    with pytest.raises(PolyampError, match="float32 reference's loss after 3 steps is nan"):
        run(nan)
    assert check_policies("bf16") == ("float32", "bf16-mixed")


def test_a_choice_the_final_rounds_find_slower_is_reverted_and_said():
    knobs = {"trick": Knob((False, True), "trick {value}")}

    final = []

    def cost(c):  # the trick is fast while it is searched, slow once the final rounds step it
        return (40 * MS if final else 5 * MS) if c.get("trick") else 20 * MS

    t = Sleeper(knobs, cost)

    def progress(text, *_):
        if text.startswith("side by side"):  # the final rounds start
            final.append(text)

    report = run(t, policies=(), budget_s=6.0, progress=progress)
    assert t.built == [Candidate.of("float32", {"trick": False}), Candidate.of("float32", {"trick": True})]
    assert [tr.status for tr in report.trials] == ["chosen", "reverted"]
    reverted = [tr for tr in report.trials if tr.status == "reverted"]
    assert len(reverted) == 1 and reverted[0].ci95[1] < 1 and reverted[0].speedup < 0.8
    assert report.tuned["float32"] == Candidate.of("float32", {"trick": False})
    assert report.best == Candidate.of("float32", {"trick": False})
    reasons = report.reasons()
    assert len(reasons) == 1 and "reverted: in the final rounds it ran" in reasons[0]
    assert "reverted" in STATUSES
    assert json.loads(json.dumps(report.to_json()))["trials"][-1]["status"] == "reverted"


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "docs" / "tune-report").glob("*.json")),
                         ids=lambda p: p.name)  # fmt: skip
def test_the_committed_reports_load_with_their_choices(path):
    """Reports saved before the baseline's candidate and the round times were (read from the labels)."""
    data = json.loads(path.read_text())
    report = TuneReport.load(path)
    assert report.best.to_json() == data["best"] and report.reasons() == data["reasons"]
    assert {p: c.to_json() for p, c in report.tuned.items()} == data["tuned"]
    pairs = zip(report.trials, data["trials"])
    assert all(t.baseline is None or t.baseline.label == d["baseline"] for t, d in pairs)
