"""ONNX Runtime's fused embedding op, `com.microsoft.EmbedLayerNormalization`, built by hand around a layer's weights.

The contrib op's inputs, in order: input_ids [B, L] int32, segment_ids [B, L] int32, word_embedding [V, H],
position_embedding [P, H], segment_embedding [T, H], gamma [H], beta [H] (mask and position_ids are optional and
left out: positions are then 0..L-1, as BERT's). Outputs: output [B, L, H] and mask_index [B] int32 (all zeros
without a mask; required by the CPU kernel, ignored here). Attribute: epsilon.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

# ORT 1.17+ reads IR version 9; newer onnx writes a newer IR by default that older runtimes refuse.
IR_VERSION = 9
OPSET = 17


def embed_layernorm_model(state_dict: dict[str, torch.Tensor], eps: float) -> Any:
    """An `onnx.ModelProto` of one EmbedLayerNormalization node, the five tables as float32 initializers.

    `state_dict` uses Hugging Face's names (word_embeddings.weight, position_embeddings.weight,
    token_type_embeddings.weight, LayerNorm.weight, LayerNorm.bias).
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    tables = {
        "word_embedding": state_dict["word_embeddings.weight"],
        "position_embedding": state_dict["position_embeddings.weight"],
        "segment_embedding": state_dict["token_type_embeddings.weight"],
        "gamma": state_dict["LayerNorm.weight"],
        "beta": state_dict["LayerNorm.bias"],
    }
    hidden = tables["gamma"].shape[0]
    initializers = [numpy_helper.from_array(t.detach().float().cpu().numpy(), name) for name, t in tables.items()]
    node = helper.make_node(
        "EmbedLayerNormalization",
        ["input_ids", "segment_ids", *tables],
        ["output", "mask_index"],
        domain="com.microsoft",
        epsilon=float(eps),
    )
    graph = helper.make_graph(
        [node],
        "bert_embeddings",
        [helper.make_tensor_value_info(n, TensorProto.INT32, ["B", "L"]) for n in ("input_ids", "segment_ids")],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["B", "L", hidden]),
         helper.make_tensor_value_info("mask_index", TensorProto.INT32, ["B"])],
        initializers,
    )
    model = helper.make_model(graph, ir_version=IR_VERSION,
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model)
    return model


def ort_session(model: Any, threads: int) -> Any:
    """A CPU-provider `InferenceSession` with `threads` intra-op threads (inter-op 1: the graph has one node)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def ort_forward(session: Any, input_ids: torch.Tensor, token_type_ids: torch.Tensor):
    """A no-argument callable running the session on int32 copies of the ids (made once, outside the call).

    Returns a function that returns the [B, L, H] output as a numpy array.
    """
    feed = {
        "input_ids": np.ascontiguousarray(input_ids.cpu().numpy().astype(np.int32)),
        "segment_ids": np.ascontiguousarray(token_type_ids.cpu().numpy().astype(np.int32)),
    }

    def run() -> np.ndarray:
        return session.run(["output"], feed)[0]

    return run
