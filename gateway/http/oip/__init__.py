"""The Open Inference Protocol (KServe "v2", what Triton and tritonclient speak): its routes, how its
tensors map onto a pipeline's items, its tensors' wire formats."""
