"""Offline model building (``shmbroker build`` and ``shmbroker check-precision``): precision conversion of ONNX
models (FP16 by converted types, INT8 by symmetric Q/DQ with calibration), their accuracy check on the CPU, and
the TensorRT engine build with its metadata sidecar. None of it runs inside the broker or its workers."""
