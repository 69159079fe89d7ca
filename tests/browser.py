"""The browser behind the web page's test (tests/test_web.py), as a pytest plugin
that conftest.py takes in: the ``chromium`` fixture and the run's closing line.

Debian's ``chromium`` (or Chrome) on the PATH drives the page; ``.ci/run``
installs it. Without one the test is skipped and the run ends with one line
saying so and how to get it (``-q`` shows no skip reasons); under CI
(``CI=true``) the test fails instead. Light on imports, so a pytest run of
this plugin alone starts fast (tests/test_web.py runs two).
"""

import os
import shutil

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
NO_BROWSER = ("the web page's browser test did not run: no chromium on the PATH "
              "(apt-get install chromium; under CI=true it fails instead)")


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


@pytest.fixture(scope="session")
def chromium():
    """The browser's path (None under CI without one: the test then fails, see
    below). Session-scoped: looked up before the test's server starts."""
    found = next((path for path in map(shutil.which, BROWSERS) if path), None)
    if found is None and not under_ci():
        pytest.skip(NO_BROWSER)
    return found


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    """Under CI a test that drives the browser fails without one (a failure of
    the test, not an error of its setup)."""
    if "chromium" in getattr(item, "funcargs", {}) and item.funcargs["chromium"] is None:
        pytest.fail("no chromium to drive under CI: apt-get install chromium (.ci/run does)", pytrace=False)


def pytest_terminal_summary(terminalreporter):
    if any(NO_BROWSER in str(r.longrepr) for r in terminalreporter.stats.get("skipped", [])):
        terminalreporter.write_line(NO_BROWSER)
