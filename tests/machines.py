"""Settings for the pure cores' hypothesis state machines: the same interleavings on every run."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings


def machine_settings(examples: int, steps: int = 40) -> settings:
    """Derandomized, no example database, generation only, the first failure reported: a broken
    variant is found (or not) identically every run."""
    return settings(max_examples=examples, stateful_step_count=steps, deadline=None, derandomize=True,
                    database=None, suppress_health_check=list(HealthCheck), phases=[Phase.generate],
                    report_multiple_bugs=False)
