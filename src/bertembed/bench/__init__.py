"""`bertembed bench`: candidates.py (the cases and what runs them), measure.py (timing, guards, the report)."""
