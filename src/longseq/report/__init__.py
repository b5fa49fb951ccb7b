"""Research outputs: each run's final metrics on disk, and tables over multirun directories.

``python -m longseq.report <multirun dir or run dirs...> [--metric test/bpd] [--by attention.name,...]``
"""

from longseq.report.outcome import METRICS_FILE, records_run_outcome, write_run_metrics

__all__ = ["METRICS_FILE", "records_run_outcome", "write_run_metrics"]
