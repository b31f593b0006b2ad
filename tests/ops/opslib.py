"""Shared helpers of the operator-asset checks (scripts/ops-check.sh)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNBOOK_BASE = "https://github.com/tollgate-rs/tollgate/blob/main/docs/runbooks/"

# What tollgate exports (README.md, "Metrics and health").
# A name used in a dashboard or rule that is not here is a typo.
COUNTERS = {
    "tollgate_permit_decisions_total",
    "tollgate_late_permits_total",
    "tollgate_shadow_decisions_total",
    "tollgate_provider_requests_total",
    "tollgate_jobs_completed_total",
    "tollgate_parked_total",
    "tollgate_dead_letters_total",
    "tollgate_tier_publishes_total",
    "tollgate_look_aheads_total",
    "tollgate_redelivered_total",
    "tollgate_tenant_label_overflow_total",
}
HISTOGRAMS = {
    "tollgate_queue_age_seconds",
    "tollgate_due_lag_seconds",
    "tollgate_quota_wait_seconds",
    "tollgate_provider_request_duration_seconds",
    "tollgate_redis_call_duration_seconds",
}
GAUGES = {
    "tollgate_jobs_in_flight",
    "tollgate_consuming",
    "tollgate_build_info",
    "tollgate_quota_effective_rate",
    "tollgate_route_effective_rate",
}
SERIES = (
    COUNTERS
    | GAUGES
    | {f"{h}{s}" for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
)


class CheckFailed(Exception):
    pass


def fail(msg: str) -> None:
    raise CheckFailed(msg)


def ok(msg: str) -> None:
    print(f"ok: {msg}", flush=True)


def rel(p: Path) -> str:
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def metric_names(expr: str) -> set[str]:
    return set(re.findall(r"\btollgate_[a-z0-9_]+", expr))


def run_checks(checks: dict, selected: list[str]) -> int:
    """Runs the named checks in order; the first failure stops with exit 1."""
    for name in selected or list(checks):
        if name not in checks:
            print(f"FAIL: unknown check {name!r}; known: {', '.join(checks)}", file=sys.stderr)
            return 2
        try:
            checks[name]()
        except CheckFailed as e:
            print(f"FAIL: {name}: {e}", file=sys.stderr, flush=True)
            return 1
    return 0


# --------------------------------------------------------------------------
# PromQL: the data-bearing parts of an alert expression.
#
# An alert expression is usually `<data> <comparison> <threshold>`, combined
# with `and` / `unless` / `or`; when the alert does not fire, the whole
# expression is legitimately empty. To prove that every part of it still
# refers to data that exists, the expression is split at its top-level
# (outside any (), [], {} or string) operator of lowest precedence:
#
#   a or b, a and b, a unless b   ->  parts(a) + parts(b)
#   a > b (any comparison)        ->  parts(a) + parts(b), number literals dropped
#   absent(x)                     ->  parts(x)   (absent() is empty while x exists)
#   anything else (a / b, f(x))   ->  [itself]: evaluated whole, must return data
#
# Operator modifiers (bool, on(...), ignoring(...), group_left/right(...))
# after an operator are dropped with it. PromQL precedence, lowest first:
# or < and, unless < comparisons < + - < * / % atan2 < ^.

_LEVELS = [("or",), ("and", "unless"), ("==", "!=", "<=", ">=", "<", ">")]
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$|^[+-]?(Inf|NaN)$", re.I)
_MODIFIERS = re.compile(
    r"^\s*(bool\b\s*)?((on|ignoring)\s*\([^)]*\)\s*)?((group_left|group_right)\b\s*(\([^)]*\))?\s*)?"
)


def _top_level_ops(expr: str):
    """(index, operator) of every operator at nesting depth 0."""
    out = []
    depth = 0
    i = 0
    n = len(expr)
    while i < n:
        c = expr[i]
        if c in "\"'`":
            j = i + 1
            while j < n and expr[j] != c:
                j += 2 if expr[j] == "\\" else 1
            i = j + 1
            continue
        if c == "#":  # comment to end of line
            while i < n and expr[i] != "\n":
                i += 1
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            two = expr[i : i + 2]
            if two in ("==", "!=", "<=", ">="):
                out.append((i, two))
                i += 2
                continue
            if c in "<>":
                out.append((i, c))
            elif c.isalpha():
                m = re.match(r"[A-Za-z_][A-Za-z0-9_:]*", expr[i:])
                word = m.group(0)
                prev = expr[i - 1] if i else " "
                if word in ("or", "and", "unless") and not (prev.isalnum() or prev in "_:"):
                    out.append((i, word))
                i += len(word)
                continue
        i += 1
    return out


def _strip_parens(expr: str) -> str:
    expr = expr.strip()
    while expr.startswith("(") and expr.endswith(")"):
        depth = 0
        for i, c in enumerate(expr):
            depth += c == "("
            depth -= c == ")"
            if depth == 0 and i != len(expr) - 1:
                return expr  # "(a) + (b)": the outer parens are not one pair
        expr = expr[1:-1].strip()
    return expr


def data_parts(expr: str) -> list[str]:
    expr = _strip_parens(expr)
    ops = _top_level_ops(expr)
    for level in _LEVELS:
        at = [(i, op) for i, op in ops if op in level]
        if at:
            i, op = at[-1]  # left-associative: split at the last one
            left = expr[:i]
            right = expr[i + len(op) :]
            right = right[_MODIFIERS.match(right).end() :]
            parts = []
            for side in (left, right):
                side = _strip_parens(side)
                if not _NUMBER.match(side):
                    parts += data_parts(side)
            return parts
    m = re.match(r"^absent\s*\((.*)\)$", expr, re.S)
    if m and _strip_parens("(" + m.group(1) + ")") == m.group(1).strip():
        return data_parts(m.group(1))
    return [expr]
