"""Model-based tests: a Hypothesis state machine over the real store (issue 6, item 3)."""
