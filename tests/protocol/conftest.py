"""The model checker's figures (states, transitions, seconds per configuration) at the end of the run's output."""


def pytest_terminal_summary(terminalreporter):
    from tests.protocol import test_model

    if test_model.RESULTS:
        terminalreporter.section("protocol model checker")
        for result in test_model.RESULTS:
            terminalreporter.write_line(result.summary())
