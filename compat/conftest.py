"""Prints the largest differences between vlenvoys and nnterp after the session."""

import test_vlenvoys_side


def pytest_terminal_summary(terminalreporter):
    if test_vlenvoys_side.DIFFERENCES:
        terminalreporter.section("largest |vlenvoys on vLLM - nnterp 1.3 on transformers| (float32)")
        for label, difference in test_vlenvoys_side.DIFFERENCES.items():
            terminalreporter.write_line(f"{label:24s} {difference:.3g}")
