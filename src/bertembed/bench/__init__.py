"""`bertembed bench`: candidates.py (cases, candidates), measure.py (timing, memory, bandwidth), report.py (output)."""
