"""Policy test results and their reports: what each step, case and file found, as text or JUnit XML.

:mod:`webhook.simulation.policy_tests` produces the results; ``csinode-guard policy test`` prints them with
:func:`format_text`, :func:`format_junit` or :func:`report_json` and exits by :func:`totals`. Pure.
"""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from webhook.admission.durations import format_duration


@dataclass(frozen=True)
class StepResult:
    """One step's outcome: what happened (``decision`` None for a step with facts only) and what failed."""

    index: int
    name: str
    offset: float
    node: str
    summary: str
    decision: str | None
    fired: tuple[str, ...]
    finals: Mapping[str, int | str | None]
    failures: tuple[str, ...]
    explanation: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    message: str = ""

    @property
    def passed(self) -> bool:
        """True when every expectation held."""
        return not self.failures


@dataclass(frozen=True)
class CaseResult:
    """One case: its steps (up to the first failing one's end), run time, or an ``error`` that stopped it."""

    name: str
    steps: tuple[StepResult, ...]
    seconds: float
    error: str | None = None

    @property
    def passed(self) -> bool:
        """True when the case ran and every step passed."""
        return self.error is None and all(s.passed for s in self.steps)


@dataclass(frozen=True)
class FileResult:
    """A test file's cases, the policy they ran against, or an ``error`` (file or policy not loadable)."""

    path: str
    cases: tuple[CaseResult, ...] = ()
    policy_source: str = ""
    policy_hash: str = ""
    error: str | None = None

    @property
    def passed(self) -> bool:
        """True when the file loaded and every case passed."""
        return self.error is None and all(c.passed for c in self.cases)


@dataclass
class Totals:
    """Counts over several files."""

    files: int = 0
    cases: int = 0
    passed: int = 0
    failed: int = 0
    errors: int = 0
    failed_names: list[str] = field(default_factory=list)


def totals(results: Sequence[FileResult]) -> Totals:
    """Sum up ``results``: cases passed and failed, files or cases that could not run."""
    t = Totals(files=len(results))
    for f in results:
        if f.error is not None:
            t.errors += 1
            t.failed_names.append(f.path)
            continue
        for c in f.cases:
            t.cases += 1
            if c.error is not None:
                t.errors += 1
                t.failed_names.append(f"{f.path}: {c.name}")
            elif c.passed:
                t.passed += 1
            else:
                t.failed += 1
                t.failed_names.append(f"{f.path}: {c.name}")
    return t


def _offset(seconds: float) -> str:
    return "+0s" if seconds <= 0 else "+" + format_duration(seconds)


def format_text(results: Sequence[FileResult], *, verbose: bool = False) -> str:
    """A readable report: PASS/FAIL per case; for a failure, each failing step's expected vs actual and why."""
    lines: list[str] = []
    for f in results:
        if f.error is not None:
            lines.append(f"ERROR {f.path}")
            lines.append(f"      {f.error}")
            continue
        lines.append(f"{f.path} (policy {f.policy_source}, hash {f.policy_hash})")
        for c in f.cases:
            if c.error is not None:
                lines.append(f"  ERROR {c.name}")
                lines.append(f"        {c.error}")
                continue
            lines.append(f"  {'PASS' if c.passed else 'FAIL'}  {c.name}")
            for s in c.steps:
                if s.passed and not verbose:
                    continue
                label = f" {s.name!r}" if s.name else ""
                status = "ok" if s.passed else "FAILED"
                lines.append(f"        step {s.index}{label} at {_offset(s.offset)} on {s.node}: {s.summary} "
                             f"-> {s.decision or '-'} [{', '.join(s.fired)}]  {status}")
                for failure in s.failures:
                    lines.append(f"          {failure}")
                if not s.passed:
                    if s.message:
                        lines.append("          denied: " + s.message.replace("\n", "\n                  "))
                    for w in s.warnings:
                        lines.append(f"          warning: {w}")
                    if s.explanation:
                        lines.append("          why:")
                        lines += [f"            {e}" for e in s.explanation]
    t = totals(results)
    summary = f"{t.cases} cases: {t.passed} passed, {t.failed} failed"
    if t.errors:
        summary += f", {t.errors} could not run"
    lines.append(summary)
    return "\n".join(lines) + "\n"


def format_junit(results: Sequence[FileResult]) -> str:
    """JUnit XML (one testsuite per file, one testcase per case) for CI systems."""
    root = ET.Element("testsuites", name="csinode-guard policy test")
    all_tests = all_failures = all_errors = 0
    for f in results:
        suite = ET.SubElement(root, "testsuite", name=f.path)
        tests = failures = errors = 0
        seconds = 0.0
        if f.error is not None:
            tests, errors = 1, 1
            case = ET.SubElement(suite, "testcase", classname=Path(f.path).stem, name="(load)")
            ET.SubElement(case, "error", message=f.error).text = f.error
        for c in f.cases:
            tests += 1
            seconds += c.seconds
            case = ET.SubElement(suite, "testcase", classname=Path(f.path).stem, name=c.name,
                                 time=f"{c.seconds:.3f}")
            if c.error is not None:
                errors += 1
                ET.SubElement(case, "error", message=c.error).text = c.error
            elif not c.passed:
                failures += 1
                failing = [s for s in c.steps if not s.passed]
                first = failing[0]
                message = f"step {first.index}: {first.failures[0]}"
                body = format_text([FileResult(f.path, (c,), f.policy_source, f.policy_hash)])
                ET.SubElement(case, "failure", message=message, type="PolicyTestFailure").text = body
        suite.set("tests", str(tests))
        suite.set("failures", str(failures))
        suite.set("errors", str(errors))
        suite.set("time", f"{seconds:.3f}")
        all_tests += tests
        all_failures += failures
        all_errors += errors
    root.set("tests", str(all_tests))
    root.set("failures", str(all_failures))
    root.set("errors", str(all_errors))
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def report_json(results: Sequence[FileResult]) -> dict[str, Any]:
    """Every file, case and step as JSON-ready dicts (``-o json|yaml``), with ``passed`` on each and the totals."""
    files = []
    for r in results:
        body = dataclasses.asdict(r)
        body["passed"] = r.passed
        for case, case_body in zip(r.cases, body["cases"], strict=True):
            case_body["passed"] = case.passed
            for step, step_body in zip(case.steps, case_body["steps"], strict=True):
                step_body["passed"] = step.passed
        files.append(body)
    t = totals(results)
    return {"files": files, "totals": {"files": t.files, "cases": t.cases, "passed": t.passed, "failed": t.failed,
                                       "errors": t.errors, "failedNames": t.failed_names}}
