"""``make sanitize``'s reading of pytest and compute-sanitizer output (CPU)."""

from tests.sanitize import outcomes, tool_errors

PYTEST_TAIL = "....E\n494 passed, 1 error in 148.38s (0:02:28)\n"


def test_outcomes_reads_pytests_closing_line():
    assert outcomes(PYTEST_TAIL) == {"passed": 494, "error": 1}
    assert outcomes("= 3 failed, 120 passed, 1 skipped in 80.1s =") == {"failed": 3, "passed": 120, "skipped": 1}
    assert outcomes("Segmentation fault\n") == {}


def test_tool_errors_reads_each_tools_summary():
    assert tool_errors(PYTEST_TAIL + "========= ERROR SUMMARY: 0 errors\n") == 0
    assert tool_errors("========= ERROR SUMMARY: 1 error\n") == 1
    assert tool_errors(PYTEST_TAIL + "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)\n") == 0
    assert tool_errors("========= RACECHECK SUMMARY: 3 hazards displayed (2 errors, 1 warning)\n") == 3
    assert tool_errors("========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n") == 1


def test_tool_errors_is_none_when_the_tool_printed_no_summary():
    assert tool_errors(PYTEST_TAIL) is None
    assert tool_errors("") is None
