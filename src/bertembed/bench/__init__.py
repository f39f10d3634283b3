"""`bertembed bench`: BERT's embedding layer against what users would run instead, on the same weights and ids.
candidates.py: the cases and candidates; measure.py: timing, peak memory, copy bandwidth and the allocator
conditions; report.py: machine, versions, the issue's targets, markdown and the terminal table."""
