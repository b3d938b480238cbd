"""docs/alerts.yml: valid rules (promtool check rules), and each alert fires on the series that should fire it
and not on the others (promtool test rules docs/alerts_test.yml). Skipped where promtool is not installed
(Debian's prometheus package has it; .ci/run installs it)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DOCS = Path(__file__).resolve().parents[2] / "docs"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install prometheus)")


@needs_promtool
@pytest.mark.parametrize("args", [("check", "rules", "alerts.yml"), ("test", "rules", "alerts_test.yml")])
def test_promtool(args: tuple[str, ...]) -> None:
    r = subprocess.run([PROMTOOL, *args], cwd=DOCS, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout + r.stderr


def test_every_alert_is_tested_and_uses_exported_names() -> None:
    rules = [r for g in yaml.safe_load((DOCS / "alerts.yml").read_text())["groups"] for r in g["rules"]]
    tests = yaml.safe_load((DOCS / "alerts_test.yml").read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case["alert_rule_test"] if t["exp_alerts"]}
    quiet = {t["alertname"] for case in tests for t in case["alert_rule_test"] if not t["exp_alerts"]}
    names = {r["alert"] for r in rules}
    assert len(names) == 5 and names == fired == quiet
    used = {re.sub(r"_(bucket|sum|count|total)$", "", n) for r in rules for n in re.findall(r"dspark_\w+", r["expr"])}
    assert used == {"dspark_kv_cache_usage_ratio", "dspark_requests_waiting", "dspark_http_requests",
                    "dspark_time_to_first_token_seconds", "dspark_decoder_failovers"}
