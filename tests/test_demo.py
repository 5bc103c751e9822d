"""``python -m cupyflash demo`` on the host (CPU): it runs in-process, its printed relative error
against the float64 reference is small, and it ends with the next command to try."""

from __future__ import annotations

import re

import pytest

from cupyflash import __main__ as cli
from cupyflash import demo


def test_demo_on_the_host(capsys: pytest.CaptureFixture[str]) -> None:
    errors = demo.run(gpu=False)
    printed = capsys.readouterr().out
    shown = [float(x) for x in re.findall(r"relative error vs the float64 reference: (\S+)", printed)]
    assert shown == [pytest.approx(errors["host"], rel=0.01)], printed
    assert 0 < errors["host"] <= demo.BOUND["float32"], printed
    assert set(errors) == {"host"}
    last = printed.strip().splitlines()[-1]
    assert last.startswith("next: python -m cupyflash "), printed


def test_demo_subcommand(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's demo calls demo.run with its --seqlen (here without a GPU, whatever the machine)."""
    seen = {}

    def fake_run(**kwargs: object) -> dict[str, float]:
        seen.update(kwargs)
        return {"host": 0.0}

    monkeypatch.setattr(demo, "run", fake_run)
    assert cli.main(["demo", "--seqlen", "2048"]) == 0
    assert seen == {"seqlen": 2048}


def test_demo_reports_a_wrong_answer(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The error it prints is measured: a wrong host result shows as a large error."""
    import cupyflash

    real = cupyflash.attention
    monkeypatch.setattr(cupyflash, "attention", lambda q, k, v, **kw: real(q, k, v, **kw) * 1.01)
    errors = demo.run(gpu=False)
    assert errors["host"] == pytest.approx(0.01, rel=0.01)
    assert "relative error vs the float64 reference: 1.00e-02" in capsys.readouterr().out
