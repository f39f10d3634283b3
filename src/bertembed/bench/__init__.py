"""`bertembed bench`: BERT's embedding layer against what users would run instead, on the same weights and ids.

    candidates.py  the cases (shapes, modes, dtypes) and the candidates: transformers eager and torch.compile,
                   ONNX Runtime's fused op, bertembed's reference and fused layers
    measure.py     interleaved timing in one process, peak memory, copy bandwidth; an allocator condition the
                   process is not in runs in a child process
    report.py      machine, commit and versions, the issue's targets, markdown and the terminal table
"""
