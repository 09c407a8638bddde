"""The dashboard in a real browser: Debian's chromium, headless, driven by
Selenium through Debian's chromedriver (nothing is downloaded). The page is
checked for what it shows against the statistics the coordinator recorded and
the counters the job reported; screenshots are kept as test artifacts (in
``$PYENGINE_TEST_ARTIFACTS``, else ``build/test-artifacts/``)."""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest
from test_monitoring import TOKEN, _counters, scenario  # noqa: F401 - the fixture is used by name

from pyengine.monitoring import Monitoring, start_monitor

webdriver = pytest.importorskip("selenium.webdriver", reason="the dashboard test needs selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
# CI installs them (.ci/run) before it runs the slow tests, so there a missing browser fails
# the test instead of skipping it. A browser is slow to start: the fast tier leaves it out.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        (CHROMIUM is None or CHROMEDRIVER is None) and not os.environ.get("CI"),
        reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)",
    ),
]
ARTIFACTS = Path(
    os.environ.get("PYENGINE_TEST_ARTIFACTS") or Path(__file__).resolve().parent.parent / "build" / "test-artifacts"
)


@pytest.fixture
def browser() -> Any:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1400,2000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _refreshed(driver: Any, after: int = 0, timeout: float = 20) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, timeout).until(
        lambda d: int(d.execute_script("return Number(document.body.dataset.refreshed || 0)")) > after
    )


def _text(driver: Any, element_id: str) -> str:
    from selenium.webdriver.common.by import By

    return str(driver.find_element(By.ID, element_id).text)


def _report(s: Any) -> None:
    """Two samples of counters: v0#0 backpressured 60% of the last second, v1#1 with a watermark."""
    s.job.counters = [
        _counters("v0", 0, records_in=1000, records_out=1000, uptime_ns=10**9),
        _counters("v0", 1, records_in=1000, records_out=1000, uptime_ns=10**9),
        _counters("v1", 0, records_in=900, uptime_ns=10**9, watermark=1_700_000_000_000),
        _counters("v1", 1, records_in=900, uptime_ns=10**9, watermark=1_700_000_000_000),
    ]
    s.monitor.sample()
    s.job.counters = [
        _counters("v0", 0, records_in=5000, records_out=5000, uptime_ns=2 * 10**9, backpressured_ns=6 * 10**8),
        _counters("v0", 1, records_in=3000, records_out=3000, uptime_ns=2 * 10**9),
        _counters("v1", 0, records_in=4000, uptime_ns=2 * 10**9, watermark=1_700_000_001_000),
        _counters("v1", 1, records_in=3500, uptime_ns=2 * 10**9, watermark=1_700_000_000_500),
    ]
    s.monitor.sample()


def _parts(stats: Any) -> Dict[str, int]:
    subs = list(stats.subtasks.values())
    return {
        "start_delay": round(max(s.start_delay_ms for s in subs)),
        "alignment": round(max(s.alignment_duration_ms for s in subs)),
        "sync": round(max(s.sync_duration_ms for s in subs)),
        "async": round(max(s.async_duration_ms for s in subs)),
    }


def test_the_dashboard_shows_the_job_its_checkpoints_and_their_subtasks(scenario: Any, browser: Any) -> None:  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    s = scenario
    _report(s)
    tracker = s.tracker
    browser.get(s.monitor.url + "?refresh=0")  # one refresh: the elements stay put while they are read
    _refreshed(browser)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "dashboard.png"))

    assert _text(browser, "job-name") == "clicks"
    assert _text(browser, "job-state") == "RUNNING"
    assert _text(browser, "job-restarts") == "1"
    assert _text(browser, "job-records") == "8,000"  # read by the sources so far
    assert _text(browser, "cp-total") == str(tracker.counts["triggered"]) == "5"
    assert _text(browser, "cp-completed") == str(tracker.counts["completed"]) == "3"
    assert _text(browser, "cp-failed") == "1" and _text(browser, "cp-in-progress") == "1"
    assert _text(browser, "cp-restored") == "1"
    assert _text(browser, "cp-latest-completed").startswith("#4 ")
    assert "disk full" in _text(browser, "cp-latest-failed")
    assert _text(browser, "cp-latest-savepoint").startswith("#3 ")
    assert _text(browser, "cp-latest-restored").startswith("#1 ")

    rows = browser.find_elements(By.CSS_SELECTOR, "#cp-history tbody tr")
    assert [int(r.get_attribute("data-checkpoint")) for r in rows] == [x.id for x in tracker.history]
    first = {c.text for c in rows[-1].find_elements(By.TAG_NAME, "td")}
    assert "UNALIGNED_CHECKPOINT" in first and "COMPLETED" in first and "4/4" in first

    # the duration chart: one bar per checkpoint, split as the coordinator recorded it
    bars = browser.find_elements(By.CSS_SELECTOR, "#cp-duration-chart g.bar")
    assert [int(b.get_attribute("data-checkpoint")) for b in bars] == [x.id for x in reversed(tracker.history)]
    for bar, stats in zip(bars, reversed(tracker.history), strict=True):
        if not stats.subtasks:
            continue
        shown = {
            r.get_attribute("data-part"): float(r.get_attribute("data-value"))
            for r in bar.find_elements(By.TAG_NAME, "rect")
        }
        for part, value in _parts(stats).items():
            assert shown[part] == value, (stats.id, part)
        if stats.status != "IN_PROGRESS":
            assert shown["end_to_end"] == round(stats.end_to_end_duration_ms)
    sizes = browser.find_elements(By.CSS_SELECTOR, "#cp-size-chart g.bar")
    completed = [x for x in reversed(tracker.history) if x.status == "COMPLETED"]
    assert [int(b.get_attribute("data-checkpoint")) for b in sizes] == [x.id for x in completed]
    for bar, stats in zip(sizes, completed, strict=True):
        shown = {
            r.get_attribute("data-part"): r.get_attribute("data-value") for r in bar.find_elements(By.TAG_NAME, "rect")
        }
        assert int(shown["incremental"]) == stats.checkpointed_size and int(shown["full"]) == stats.full_size

    # the job graph: per-subtask throughput and backpressure from the reported counters
    graph = browser.find_elements(By.CSS_SELECTOR, "#graph g.vertex-group")
    assert [g.get_attribute("data-vertex") for g in graph] == ["v0", "v1"]
    pressure = [
        float(r.get_attribute("data-backpressure"))
        for r in graph[0].find_elements(By.CSS_SELECTOR, "rect[data-backpressure]")
    ]
    assert pressure == pytest.approx([0.6, 0.0])
    levels = [r.get_attribute("class") for r in graph[0].find_elements(By.CSS_SELECTOR, "rect[data-backpressure]")]
    assert levels == ["bp-high", "bp-ok"]
    rates = [float(t.get_attribute("data-rate")) for t in graph[0].find_elements(By.CSS_SELECTOR, "text.subtask-rate")]
    latest = s.monitor.history.latest
    assert rates == pytest.approx([latest.subtasks[("v0", i)].records_in_per_s for i in range(2)])
    assert browser.find_elements(By.CSS_SELECTOR, "#watermark-chart path[data-series='lag']")
    shown = browser.find_element(By.CSS_SELECTOR, "#watermark-chart text[data-watermark]").get_attribute(
        "data-watermark"
    )
    assert shown == "2023-11-14T22:13:20.500Z"  # the lowest subtask watermark: 1_700_000_000_500 ms
    assert browser.find_elements(By.CSS_SELECTOR, "#throughput-chart path[data-series='read/s']")

    # select checkpoint 1 (unaligned): its subtasks, as recorded
    bars[0].click()
    WebDriverWait(browser, 10).until(lambda d: _text(d, "selected-checkpoint") == "#1")
    WebDriverWait(browser, 10).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#subtask-table tbody tr")) == 4)
    stats = next(x for x in tracker.history if x.id == 1)
    for row in browser.find_elements(By.CSS_SELECTOR, "#subtask-table tbody tr"):
        cells: List[str] = [c.text for c in row.find_elements(By.TAG_NAME, "td")]
        sub = stats.subtasks[f"{row.get_attribute('data-vertex')}#{row.get_attribute('data-subtask')}"]
        assert cells[2] == "completed"
        assert cells[4] == f"{sub.ack_timestamp - stats.trigger_timestamp:,} ms"
        assert cells[7] == f"{round(sub.sync_duration_ms):,} ms" and cells[8] == f"{round(sub.async_duration_ms):,} ms"
        assert cells[9] == f"{round(sub.alignment_duration_ms):,} ms"
        assert cells[12] == f"{round(sub.start_delay_ms):,} ms"
        assert cells[13] == ("yes" if sub.unaligned else "no")
    browser.save_screenshot(str(ARTIFACTS / "dashboard-checkpoint-1.png"))
    assert browser.find_elements(By.ID, "error")[0].get_attribute("hidden") is not None  # no error shown


def test_the_dashboard_works_behind_a_token(scenario: Any, browser: Any) -> None:  # noqa: F811
    s = scenario
    monitor = start_monitor(s.job, Monitoring(token=TOKEN, sample_interval_s=60, progress=False), out=io.StringIO())
    assert monitor is not None and monitor.url is not None
    try:
        browser.get(monitor.url)  # no token: the page's own requests are refused
        assert "a token is needed" in browser.page_source
        browser.get(monitor.url + "?token=" + TOKEN)  # the first visit with it sets the cookie
        _refreshed(browser)
        assert _text(browser, "cp-completed") == "3"
        before = int(browser.execute_script("return Number(document.body.dataset.refreshed)"))
        _refreshed(browser, after=before)  # and the page keeps refreshing on the cookie
        browser.save_screenshot(str(ARTIFACTS / "dashboard-token.png"))
    finally:
        monitor.stop("FINISHED")
